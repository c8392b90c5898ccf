"""The data: ChestX-ray14's layout and split (``chestxray``), the generated stand-in (``synthetic``), the one decode
rule (``image_io``), the copy prepared once for training (``prepare``) and the augmentation's parameters
(``image_transforms``). Framework-neutral: importable in every environment."""

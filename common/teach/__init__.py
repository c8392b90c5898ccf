"""Teaching: the notebooks' exercises and their answers, the speed-up toolbox's tables, and the workshop handout.
Framework-neutral: importable in every environment."""

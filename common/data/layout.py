"""Where things are: the file names of NIH's ChestX-ray14 release, and the cache folder where generated and prepared
data sets are kept. The other data modules build on this one, which imports none of them."""

from __future__ import annotations

import os
from pathlib import Path

CSV_NAME = "Data_Entry_2017.csv"
TRAIN_VAL_LIST = "train_val_list.txt"
TEST_LIST = "test_list.txt"
NO_FINDING = "No Finding"


def cache_root() -> Path:
    """Where generated data sets are kept: ``$CHESTXRAY_CACHE``, else the user's cache folder."""
    if os.environ.get("CHESTXRAY_CACHE"):
        return Path(os.environ["CHESTXRAY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multigpu-notebooks"

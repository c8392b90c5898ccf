"""Measuring a run: the device monitor, the phases of its time, ROC AUC, the results records, the diagnosis, the
report and plots built from the records, and the input-pipeline benchmark. Framework-neutral: importable in every
environment."""

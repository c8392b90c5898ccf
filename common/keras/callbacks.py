"""Keras callbacks of the ``model.fit`` notebooks, on either backend: each epoch's history, phases and checkpoint,
the exact validation AUC, and the benchmark's step timer; and Keras' own test AUC, set beside the exact one."""

from __future__ import annotations

import time

import keras
import numpy as np

from common.measure import metrics
from common.measure.phases import Phases
from common.run import checkpoints
from common.run.params import NUM_CLASSES


class ExactAUC(keras.callbacks.Callback):
    """After each epoch, the mean ROC AUC on ``data`` computed as every notebook does, logged as ``val_exact_auc``.

    ``keras.metrics.AUC(multi_label=True)`` counts a finding without positives in the data as 0; the
    small validation split of a demo lacks some findings, so its Keras AUC reads far too low.
    """

    def __init__(self, data, labels: np.ndarray):
        super().__init__()
        self.data, self.labels = data, labels
        self.history: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        # on JAX the last batch is padded to a full one, which every device can share: its padding is scored too
        scores = self.model.predict(self.data, verbose=0)[: len(self.labels)]
        auc = metrics.roc_auc(self.labels, scores).mean
        self.history.append(auc)
        if logs is not None:
            logs["val_exact_auc"] = auc


class EpochLog(keras.callbacks.Callback):
    """Each epoch's history and phases and, with a ``folder``, a checkpoint after it (:mod:`common.run.checkpoints`).

    Training time runs from the epoch's start to the start of validation (``on_test_begin``), as every notebook
    counts it; the first steps of the first epoch (tracing or compiling the step) are a phase of their own.
    ``model.fit`` fetches its batches inside the traced step on TensorFlow, and between steps without timing the wait
    on JAX: the time spent waiting for data is not visible here either way and is recorded as unmeasured (None).

    ``model.save_weights`` saves the optimizer's state with the weights, its step counter and so the learning-rate
    schedule included; the file is written under a temporary name and renamed. Not ``keras.callbacks.BackupAndRestore``:
    in Keras 3.15 it overwrites ``latest.weights.h5`` in place and writes the epoch number after it, so a kill during
    the save can leave a corrupt file, or one epoch's weights under the number of the epoch before.
    Put it last in the callbacks: it reads what ``valid_auc`` recorded for the epoch.
    """

    def __init__(self, phases: Phases, valid_auc: ExactAUC, history: dict, folder=None, settings=None):
        super().__init__()
        self.phases, self.valid_auc, self.history = phases, valid_auc, history
        self.folder, self.settings = folder, settings
        self._start = self._training = self._validating = None
        self._traced = False

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._training = time.time()
        self._validating = None

    def on_train_batch_end(self, batch, logs=None):
        if not self._traced:  # the first step of the run traces the step into a graph
            float(logs["loss"])  # reading the loss back waits for it to finish
            self._training = time.time()
            self.phases.add("first steps", self._start, self._training)
            self._traced = True

    def on_test_begin(self, logs=None):
        if self._start is not None and self._validating is None:
            self._validating = time.time()

    def on_epoch_end(self, epoch, logs=None):
        now = time.time()
        validating = self._validating or now
        self.phases.add("train", self._training, validating, epoch + 1)
        self.phases.add("validate", validating, now, epoch + 1)
        self.history["epoch_seconds"].append(validating - self._start)
        self.history["train_loss"].append(float(logs["loss"]))
        self.history["valid_auc"].append(self.valid_auc.history[-1])
        self.history["data_wait_seconds"].append(None)
        if self.folder is not None:
            with self.phases("checkpoint", epoch + 1):
                checkpoints.save(
                    self.folder,
                    epoch + 1,
                    ".weights.h5",
                    lambda path: self.model.save_weights(str(path)),
                    self.settings,
                    self.history,
                )


class StepTimer(keras.callbacks.Callback):
    """Images per second of ``model.fit`` steps after ``warmup`` untimed ones (tracing, allocation); ``phases`` (a
    :class:`common.measure.phases.Phases`) gets the warm-up and the timed steps."""

    def __init__(self, global_batch: int, warmup: int = 2, phases: Phases | None = None):
        super().__init__()
        self.global_batch, self.warmup, self.phases = global_batch, warmup, phases
        self._times: list[float] = []

    def on_train_begin(self, logs=None):
        self._times = [time.time()]

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # reading the loss back waits for the devices to finish the step
        self._times.append(time.time())

    def on_train_end(self, logs=None):
        if self.phases is not None and len(self._times) > self.warmup + 1:
            self.phases.add("benchmark warm-up", self._times[0], self._times[self.warmup])
            self.phases.add("benchmark", self._times[self.warmup], self._times[-1])

    @property
    def images_per_second(self) -> float:
        timed = self._times[self.warmup :]
        if len(timed) < 2:
            raise ValueError(f"time at least {self.warmup + 1} steps, not {len(self._times) - 1}")
        return (len(timed) - 1) * self.global_batch / (timed[-1] - timed[0])


def load_checkpoint(checkpoint: checkpoints.Checkpoint, model: keras.Model) -> tuple[int, dict]:
    """Load what :class:`EpochLog` saved into a compiled model (on TensorFlow inside the strategy's scope); returns
    the epochs finished and the history."""
    model.optimizer.build(model.trainable_variables)  # the optimizer's slots must exist to take their saved values
    model.load_weights(str(checkpoint.state))
    return checkpoint.epoch, checkpoint.history


def keras_test_auc(model: keras.Model, data, auc: metrics.AUC, images: int) -> float:
    """``keras.metrics.AUC`` (compiled as ``"auc"``) on the test ``data`` of ``images`` images, comparable with the
    exact ``auc``: Keras keeps a finding without positive test images in its mean, with an AUC of 0, so its figure is
    rescaled to the findings the exact AUC defines. Prints both."""
    keras_auc = model.evaluate(data, verbose=0, return_dict=True)["auc"]
    if auc.undefined:
        print(
            f"keras.metrics.AUC scored {', '.join(f'{name} ({why})' for name, why in auc.why_undefined.items())} as 0; "
            "rescaled:"
        )
        keras_auc *= NUM_CLASSES / (NUM_CLASSES - len(auc.undefined))
    print(
        f"test mean ROC AUC {auc.mean:.3f} over {images} images; keras.metrics.AUC: {keras_auc:.3f} "
        f"(difference {abs(auc.mean - keras_auc):.3f})"
    )
    return keras_auc

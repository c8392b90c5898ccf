"""Import TensorFlow and Keras in this project: the one place that quiets TensorFlow's C++ notices and picks its CPU
kernels.

On x86 CPUs TensorFlow uses its oneDNN kernels (convolutions, matrix products, batch norm) by default only where the CPU
has AVX-512 neural-network instructions (VNNI, BF16, AMX); elsewhere, AVX2 laptops and AMD servers among them, it
falls back to its Eigen kernels. ``TF_ENABLE_ONEDNN_OPTS`` defaults to 1 here on every x86 CPU: on a 2-core AVX2 AMD
EPYC, a training step of the notebooks' DenseNet-121 (16 images of 64 px per device, ``python -m
common.tensorflow.first_step --one fused``) took 0.44-0.59 s with them and 1.09-2.36 s without on one device,
0.72-1.13 s and 1.55-2.24 s on two (3 or 4 runs each, alternated); the first step, 53-70 s on two devices, was as
slow either way. Set it to 0 to compare.

TensorFlow's C++ INFO and WARNING lines go to the process's standard error, which a notebook shows in red:
``TF_CPP_MIN_LOG_LEVEL`` defaults to 2 here (errors only), as ``make run`` and the tests run the notebooks and as a
person sees them in JupyterLab.

While its C++ libraries load, before their logging is set up, TensorFlow writes notices straight to the process's
standard error, where ``TF_CPP_MIN_LOG_LEVEL`` does not reach them: every run of a TensorFlow notebook on a machine
without a GPU showed them in red, among them "E0000 ... failed call to cuInit", which says only that there is no GPU.
Here standard error is caught at the file-descriptor level while TensorFlow loads and looks for its GPUs, and every
line is passed on but those notices. The cuInit failure is dropped only where NVML finds no GPU: on a GPU machine it is
the error that explains why TensorFlow sees none.

A distributed dataset (``experimental_distribute_dataset``, and ``model.fit`` under a strategy) reads through a
``MultiDeviceIterator``, which gives each device a dataset of its own: a generator of that device's share and a prefetch
of one element, iterated with tf.data's default options. Autotuning is on there, with nothing to tune, and each
device's iterator starts tf.data's autotune thread; destroying the iterator, which Keras does after every epoch's
evaluation and at the end of ``fit``, waited for that thread's next wake-up, whose period grows to a minute. On one
simulated device a 2-epoch ``fit`` of the notebooks' DenseNet-121 returned 19.8 and 20.5 s after its last epoch, and
took 110.2 and 108.7 s in all; with autotuning off on the devices' datasets, 0.0 and 0.0 s after it, 73.9 and 74.1 s in
all (two runs each, alternated). The dataset the notebooks pass keeps its autotuning: its parallel reads need it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
import tempfile

from common.run import devices

_MESSAGE = re.compile(r"[IWEF]\d{4} [\d:.]+ +\d+ \S+\] ")  # the prefix of an absl log message
_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_NO_GPU = re.compile(r"E\d{4} [\d:.]+ +\d+ \S+\] failed call to cuInit")
X86 = platform.machine() in ("x86_64", "AMD64")  # where TF_ENABLE_ONEDNN_OPTS defaults to 1 (see above)
_NO_ONEDNN_TYPE = re.compile(r"E\d{4} [\d:.]+ +\d+ \S+\] oneDNN supports DT_\w+ only on platforms with AVX-512")


@contextlib.contextmanager
def quiet_start_up(gpu_present: bool):
    """Pass on what the process writes to file descriptor 2 inside the block, but TensorFlow's start-up notices."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode(errors="replace")
            sys.stderr.write("".join(kept_lines(text, gpu_present)))


def kept_lines(text: str, gpu_present: bool) -> list[str]:
    """The lines of ``text`` but the start-up notices: the banner, INFO messages (the oneDNN notice, "Could not find
    cuda drivers", the CPU instructions it was not built for), the oneDNN data-type notice of
    :func:`quiet_first_graph_notices` and, without a GPU, the cuInit failure. A message's continuation lines go with
    it."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(_BANNER):
            dropping = False
            continue
        if _MESSAGE.match(line):
            dropping = (
                line.startswith("I")
                or (not gpu_present and bool(_NO_GPU.match(line)))
                or bool(_NO_ONEDNN_TYPE.match(line))
            )
        if not dropping:
            kept.append(line)
    return kept


if "tensorflow" not in sys.modules:
    # for example the tf.data notices of every Keras fit; read once, when TensorFlow's libraries load
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if X86:
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    with quiet_start_up(gpu_present=bool(devices.gpu_names())):
        import keras
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")  # where TensorFlow calls cuInit
import keras  # noqa: E402  (imported above unless it already was)
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("WARNING")  # tf.distribute logs every cross-device reduction at INFO level


def _device_datasets_without_autotuning() -> None:
    """Turn autotuning off on the datasets a ``MultiDeviceIterator`` makes for each device (see above)."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    create = multi_device_iterator_ops._create_device_dataset

    def create_without_autotuning(*args, **kwargs):
        options = tf.data.Options()
        options.autotune.enabled = False
        return create(*args, **kwargs).with_options(options)

    multi_device_iterator_ops._create_device_dataset = create_without_autotuning


_device_datasets_without_autotuning()


def quiet_first_graph_notices() -> None:
    """Run once the devices and the strategy are set up (the first graph starts TensorFlow's runtime, after which
    neither can change).

    The first graph that transposes booleans, as ``keras.metrics.AUC`` does in a Keras notebook's first training step,
    makes TensorFlow log "E0000 ... oneDNN supports DT_BOOL only on platforms with AVX-512. Falling back to the default
    Eigen-based implementation", in red, on every x86 CPU, AVX-512 or not. It is a notice, logged once per process: this
    graph has it logged here, where it is caught.
    """
    with quiet_start_up(gpu_present=bool(devices.gpu_names())):
        tf.function(tf.transpose)(tf.eye(2) > 0)  # 2x2: grappler turns a 1x1 transpose into nothing


__all__ = ["keras", "tf"]

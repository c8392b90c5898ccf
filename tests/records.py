"""A complete results record for tests, with any field changed."""

from common.measure import results


def complete_record(**changes) -> dict:
    fields = dict(
        framework="pytorch",
        notebook="PyTorch_MultiGPU",
        devices=2,
        device_kind="cpu",
        device_names=["cpu:0", "cpu:1"],
        precision="fp32",
        global_batch=32,
        image_size=64,
        epochs=3,
        data="generated",
        train_images=700,
        epoch_seconds=[12.5, 10.0, 10.1],
        images_per_second=69.7,
        test_auc=0.71,
        per_class_auc={"Hernia": None, "Mass": 0.8},
        device_utilization={"cpu": {"utilization_mean_percent": 91.0, "memory_peak_mib": 2048.0}},
        versions={"python": "3.11.9", "torch": "2.4.0"},
    )
    fields.update(changes)
    return results.new_record(**fields)

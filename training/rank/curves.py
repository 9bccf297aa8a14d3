"""The training curves rank 0 draws into the run directory (curves.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(metrics: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch (averaged over ranks), with the test accuracy marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = metrics["history"]
    first = metrics["resumed_after_epoch"] + 1
    epochs = list(range(first, first + len(history["loss"])))
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(epochs, history["loss"], marker="o")
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="loss")
    accuracy_axes.plot(epochs, history["accuracy"], marker="o", label="training (all ranks)")
    if "val_loss" in history:
        loss_axes.plot(epochs, history["val_loss"], marker="o", label="validation")
        loss_axes.legend(loc="upper right")
        accuracy_axes.plot(epochs, history["val_accuracy"], marker="o", label="validation")
    if "test_accuracy" in metrics:
        accuracy_axes.axhline(
            metrics["test_accuracy"],
            color="tab:green",
            linestyle="--",
            label=f"test {metrics['test_accuracy']:.4f}",
        )
    accuracy_axes.set(title="accuracy", xlabel="epoch", ylabel="accuracy")
    accuracy_axes.legend(loc="lower right")
    for axes in (loss_axes, accuracy_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(
        f"{metrics['num_ranks']} ranks, global batch {metrics['global_batch_size']}, "
        f"{metrics['backward_passes_per_step']} backward passes per step"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

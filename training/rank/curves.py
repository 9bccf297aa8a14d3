"""The training curves rank 0 draws into the run directory (curves.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(metrics: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch (averaged over ranks), with the test accuracy marked.

    Only the epochs this run trained are in its history: a run resumed after its last epoch
    (killed while it evaluated or committed) trained none, and its curves show the test
    accuracy alone."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history: dict[str, list[float]] = metrics["history"]
    first = metrics["resumed_after_epoch"] + 1
    figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(10, 4))
    for axes, series in (
        (loss_axes, (("loss", "training (all ranks)"), ("val_loss", "validation"))),
        (accuracy_axes, (("accuracy", "training (all ranks)"), ("val_accuracy", "validation"))),
    ):
        for key, label in series:
            values = history.get(key, [])
            if values:
                epochs = list(range(first, first + len(values)))
                axes.plot(epochs, values, marker="o", label=label)
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="loss")
    if not history.get("loss"):
        loss_axes.set_title(f"training loss: no epoch trained after epoch {first - 1}")
    if "val_loss" in history:
        loss_axes.legend(loc="upper right")
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

"""The parts of the rank program (training/worker.py), each with one job: setup, model,
resume, data, callbacks (and the callbacks' own modules: schedule, divergence, checkpointing,
meters), metrics, curves. The launcher imports only ``config`` (WorkerConfig) and ``run_dir``;
the callback modules import TensorFlow when they are imported, so a rank imports them after
:func:`setup.pin_to_one_core`."""

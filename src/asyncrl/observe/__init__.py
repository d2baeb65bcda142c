"""Seeing a run: metric sinks (JSONL, TensorBoard, W&B), plots, the live dashboard and the
merged Chrome-trace timeline. Nothing here imports torch."""

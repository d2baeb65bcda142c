"""Supervised fine-tuning: ``asyncrl sft RECIPE``.

The recipe (:mod:`asyncrl.sft.config`), examples rendered with the chat template and
masked to their answers (:mod:`asyncrl.sft.data`), the masked cross-entropy
(:mod:`asyncrl.sft.loss`) stepped by the train engine (:mod:`asyncrl.sft.engine`), held-out
accuracy by greedy decoding (:mod:`asyncrl.sft.evaluate`), and the step loop
(:mod:`asyncrl.sft.run`). Its checkpoints are the GRPO trainer's, so an RL recipe starts
from ``<run>/hf`` with ``model.path``.
"""

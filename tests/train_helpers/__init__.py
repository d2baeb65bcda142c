"""Shared pieces of the train-engine tests: tiny model configs, synthetic batches, and a
worker script that runs engine steps in a fresh process or under torchrun."""

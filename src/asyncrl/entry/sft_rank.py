"""Entry point of one SFT rank: ``python -m asyncrl.entry.sft_rank RUN_DIR`` (started by
torchrun or directly for one rank, by :func:`asyncrl.sft.run.sft`)."""

import os

from asyncrl.sft.rank import main
from asyncrl.train.torchrun import rank_main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rank_main(main)

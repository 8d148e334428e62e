"""Attention benchmark: qkv against torch SDPA, naive PyTorch and compiled Flex.

The implementation lives in ``qkv.bench`` so that ``qkv bench`` runs the same thing:

    python benchmarks/bench_attention.py --help
"""

from qkv.cli.bench import main

if __name__ == "__main__":
    main()

"""hybrax.bench: the benchmark runner, its results as data, and the summary generated from them.

    python -m hybrax.bench --op OP [--impl ...] [--shapes NAME,...] [--anchors fla,tokamax,jla,cudnn,jax_nn]
                           [--dtype bf16] [--mode fwd,fwd+bwd] [--out benchmarks/results] [--base REV] [--smoke]
    python -m hybrax.bench.summary [--results benchmarks/results] [--out BENCHMARKS.md]

shapes.py names problem sizes ("kda-1x8192x32x128"); workloads/ says what each op runs and counts; anchors/ runs
other libraries on the same inputs; timer.py is the one timer; results.py appends JSON lines under
benchmarks/results/<device>/<op>.jsonl; summary.py writes BENCHMARKS.md from them and plots.py its PNG plots;
base_revision.py runs the same benchmark on another revision first, an anchor of ours (before / after a change).
"""

"""Import stand-in for Hugging Face ``datasets`` on a GPU host without network (the kit lacks it).

``sglang.benchmark.datasets`` imports ``load_dataset`` at module load for its MMMU loader;
``--dataset-name random-ids`` never calls it. ``benchmarks/served_speed.py`` puts this folder on
bench_serving's ``PYTHONPATH`` only when the real package cannot be imported.
"""


def load_dataset(*args, **kwargs):
    raise RuntimeError("Hugging Face datasets is not installed here (offline); use --dataset-name random-ids")

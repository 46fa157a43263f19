"""Gate training: frozen backbone runner, student attentions, offline corpus, trainer (CLI: ``__main__``)."""

from sglang_wgkv.training.backbone import Backbone, load_backbone
from sglang_wgkv.training.corpus import Corpus, CorpusSpec, build_corpus
from sglang_wgkv.training.trainer import GateTrainer, TrainConfig

__all__ = ["Backbone", "Corpus", "CorpusSpec", "GateTrainer", "TrainConfig", "build_corpus", "load_backbone"]

"""The research apparatus behind ``data/results/``: the studies that produced the capstone's recorded results.

Not what a student needs to read to understand cramming (that is ``recipe``, ``data``, ``pretrain``,
``finetune`` and ``evaluate`` one folder up); this is how the lesson's recorded numbers were measured,
kept so that every file in ``data/results/`` can be read back, checked and extended.

study              run_study: every model on every task under the evaluation protocol, one JSON (the
                   ``evaluate`` command); encoders: the models it scores; calibration: the reference rows
                   (majority class, TF-IDF, unigram cross-entropy)
more_seeds         add_seeds: more test seeds for a finished study's fine-tuned rows, at the rates dev chose
widen_sweep        widen_sweep: more rates in a finished study's sweep, test run again where the choice moves
minilm_row         add_minilm: MiniLM fine-tuned added to a finished study, every fine-tune journaled
report             the recorded studies read back: tables, headline, budget and reference tables
significance       paired_gap: the paired t-test of a gap over seeds, and the exact sign-flip test beside it
probe_curve        run_probe_curve: the linear probe at a run's checkpoints against random init
                   (the reading in probe_curve_report)
scaling            run_scaling: MLM loss against tokens and seconds, sizes x shapes under one budget (the grid
                   in scaling_grid, the machinery shared with the vocabulary study in budget_runs, the
                   reading in scaling_report)
vocab_study        run_vocab_study: vocabulary sizes under one budget (the reading in vocab_report)
"""

from .probe_curve import run_probe_curve
from .probe_curve_report import load_probe_curve
from .scaling import GRIDS, run_scaling
from .scaling_report import load_scaling
from .study import StudyConfig, run_study
from .vocab_report import load_vocab_study
from .vocab_study import VOCAB_SIZES, run_vocab_study

__all__ = [
    "GRIDS",
    "StudyConfig",
    "VOCAB_SIZES",
    "load_probe_curve",
    "load_scaling",
    "load_vocab_study",
    "run_probe_curve",
    "run_scaling",
    "run_study",
    "run_vocab_study",
]

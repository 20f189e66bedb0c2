"""The retrieval study's report: its verdict reads the kNN-LM weight declared before the run, never the best on test."""

import pytest

from llmedu.retrieval.study import DECLARED_LAMBDA, study_report


def _study(knn_losses: dict[float, float], large: float = 1.50, se: float = 0.005) -> dict:
    """A recorded study in the shape run_study writes, with chosen losses and one standard error for all rows."""
    loss = {"small": 1.46, "large": large, **{f"small + kNN-LM, lambda {lam:g}": v for lam, v in knn_losses.items()}}
    loss["unigram"] = 3.0
    training = {
        name: dict(
            lr=1e-3,
            best_dev=1.4,
            best_step=4000,
            stopped="max_steps reached",
            distinct_rows=10,
            parameters=1,
            flops_per_byte=1e6,
        )
        for name in ("small", "large")
    }
    return dict(
        provenance=[dict(command="test", date="today", machine="cpu", threads=1, wall_seconds=1.0)],
        config=dict(m=32, lams=list(knn_losses)),
        training=training,
        text=dict(training_rows=100, datastore_rows=10, keys=320, m=32),
        datastore=dict(bytes=1e6, search_flops_per_byte=1e6),
        test=dict(rows=3, books=["A"], rows_per_book=[3]),
        loss=loss,
        loss_by_book={name: [v] for name, v in loss.items()},
        against_large={n: dict(difference=v - large, standard_error=se) for n, v in loss.items() if n != "large"},
    )


def test_the_verdict_reads_the_declared_lambda_not_the_best_one_on_test():
    # at the declared lambda the kNN-LM ties the large LM; a larger lambda, picked after the fact, would be below it
    study = _study({0.0: 1.46, DECLARED_LAMBDA: 1.50, 0.5: 1.40})
    verdict = study_report(study).splitlines()[-1]
    assert f"lambda {DECLARED_LAMBDA:g}" in verdict and "not resolved from the large LM" in verdict


def test_a_study_without_the_declared_lambda_is_refused():
    with pytest.raises(ValueError, match="no row"):
        study_report(_study({0.0: 1.46, 0.5: 1.40}))

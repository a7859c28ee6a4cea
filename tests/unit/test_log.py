"""The rank-0 logger (e2v/runtime/log.py): each line of a message tagged with its stage, leading
newlines kept in front, only rank 0 speaking unless a record says every rank, errors on stderr,
and nothing passed on to the root logger (a host program's handlers would print lines twice)."""

from __future__ import annotations

import logging

import pytest

from e2v.runtime.log import EVERY_RANK, get_logger


def test_lines_are_tagged_by_stage(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    get_logger("e2v.dry run").info("config OK\nplan:\n  zero2")
    get_logger().info("\nstop signal: saved")
    assert capsys.readouterr().out == ("[e2v dry run] config OK\n[e2v dry run] plan:\n[e2v dry run]   zero2\n"
                                       "\n[e2v] stop signal: saved\n")


def test_only_rank_zero_speaks_unless_every_rank(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # the launcher's rank, before the process group exists
    log = get_logger("e2v.data")
    log.info("rank 0's summary")
    log.warning("this rank's file is unreadable", extra=EVERY_RANK)
    assert capsys.readouterr().out == "[e2v data] this rank's file is unreadable\n"
    monkeypatch.setenv("RANK", "0")
    log.info("rank 0's summary")
    assert capsys.readouterr().out == "[e2v data] rank 0's summary\n"


def test_errors_go_to_stderr_and_not_to_the_root_logger(capsys, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.INFO):  # pytest's handler sits on the root logger
        get_logger().error("error in step 3: saving step 2 first")
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "[e2v] error in step 3: saving step 2 first\n")
    assert caplog.records == []


def test_a_logger_outside_e2v_is_refused():
    with pytest.raises(ValueError, match="e2v.<stage>"):
        get_logger("train")

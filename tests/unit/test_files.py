"""Files replaced in one step (e2v/runtime/files.py): a write that fails leaves the old file as it
was and no temporary behind; one that succeeds replaces it whole."""

import pytest

from e2v.runtime.files import replacing, write_text_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    f = tmp_path / "latest"
    f.write_text("step_000001")
    with pytest.raises(OSError, match="disk full"):
        with replacing(f) as tmp:
            tmp.write_text("step_0000")  # half written when the disk fills
            raise OSError("disk full")
    assert f.read_text() == "step_000001" and sorted(tmp_path.iterdir()) == [f]
    write_text_atomic(f, "step_000002", durable=True)
    assert f.read_text() == "step_000002" and sorted(tmp_path.iterdir()) == [f]

from pathlib import Path

from e2v.config.schema import Dataset, Element
from e2v.data.elements import discover, strip_caption_prefix


def touch(p: Path, text: str = "x"):
    p.write_text(text)


def test_alternative_suffixes_first_existing_wins(tmp_path):
    for i in ("001", "002"):
        touch(tmp_path / f"{i}.mp4")
        touch(tmp_path / f"{i}.txt", f"prompt {i}")
    touch(tmp_path / "001_dog.png")
    touch(tmp_path / "001_mask.png")  # later suffix: must lose to _dog.png
    touch(tmp_path / "002_mask.png")
    touch(tmp_path / "002_toy.png")
    els = [Element("main_subject", ["_dog.png", "_person.png", "_mask.png"], True),
           Element("secondary", ["_object.png", "_toy.png"], False)]
    samples, problems = discover(Dataset(data_root=str(tmp_path)), els)
    assert problems == []
    by_id = {s.id: s for s in samples}
    assert by_id["001"].elements == {"main_subject": tmp_path / "001_dog.png"}
    assert by_id["002"].elements == {"main_subject": tmp_path / "002_mask.png", "secondary": tmp_path / "002_toy.png"}
    assert by_id["002"].prompt == "prompt 002"


def test_missing_required_element_is_reported_with_suffixes(tmp_path):
    touch(tmp_path / "003.mp4")
    touch(tmp_path / "003.txt", "p")
    touch(tmp_path / "003_background.png")
    els = [Element("main_subject", ["_dog.png", "_person.png"], True),
           Element("environment", ["_background.png"], False)]
    samples, problems = discover(Dataset(data_root=str(tmp_path)), els)
    assert samples == []
    assert len(problems) == 1
    p = problems[0]
    assert p.sample == "003" and "main_subject" in p.problem
    assert "003_dog.png" in p.fix and "003_person.png" in p.fix


def test_caption_prefix_removal():
    assert strip_caption_prefix("The video shows a dog running.") == "A dog running."
    assert strip_caption_prefix("In this video, a cat sleeps") == "A cat sleeps"
    assert strip_caption_prefix("A dog runs") == "A dog runs"


def test_csv_and_jsonl_sources_with_npz_and_element_columns(tmp_path):
    import json

    import numpy as np

    (tmp_path / "clips").mkdir()
    np.savez(tmp_path / "clips/a.npz", frames=np.zeros((5, 16, 16, 3), np.uint8))
    (tmp_path / "meta.csv").write_text("video,prompt,person\nclips/a.npz,The video shows a cat,p.png\n")
    (tmp_path / "train.jsonl").write_text(json.dumps({"path": "clips/a.npz", "prompt": "x", "person": "q.png"}) + "\n\n")
    els = [Element("person", [], True)]
    csv_s, _ = discover(Dataset(data_root=str(tmp_path), dataset_type="csv", metadata_path="meta.csv"), els,
                        strip_prefixes=True, dataset_index=1)
    assert csv_s[0].video == tmp_path / "clips/a.npz" and csv_s[0].prompt == "A cat" and csv_s[0].dataset == 1
    assert csv_s[0].elements == {"person": tmp_path / "p.png"}
    js, _ = discover(Dataset(data_root=str(tmp_path), dataset_type="jsonl", metadata_path="train.jsonl"), els)
    assert len(js) == 1 and js[0].elements == {"person": tmp_path / "q.png"} and js[0].prompt == "x"
    (tmp_path / "train.jsonl").write_text('{"path": "clips/a.npz"}\n')
    import pytest

    with pytest.raises(ValueError, match="row 1 needs 'path' and 'prompt'"):
        discover(Dataset(data_root=str(tmp_path), dataset_type="jsonl", metadata_path="train.jsonl"), els)


def test_duplicate_ids_and_orphans(tmp_path):
    from e2v.data.elements import orphan_files

    for name in ("001.mp4", "001.mov", "001_person.png", "002.mp4", "002.txt", "002_person.png", "003_person.png", "002_persn.png"):
        touch(tmp_path / name)
    els = [Element("person", ["_person.png"], True)]
    samples, problems = discover(Dataset(data_root=str(tmp_path)), els)
    assert [s.id for s in samples] == ["002"]
    assert [(p.sample, p.kind) for p in problems] == [("001", "duplicate_id")]
    assert [p.name for p in orphan_files(Dataset(data_root=str(tmp_path)), els)] == ["002_persn.png", "003_person.png"]


def test_table_paths_are_relative_to_the_metadata_folder_or_media_root(tmp_path):
    """A CSV in a subfolder: its video and element paths resolve against its own folder (a decoy of
    the same relative path under data_root must not be picked); media_root overrides that folder
    (the regression seed's dataset_base_path). Prompts name their source line."""
    import json

    for base in (tmp_path, tmp_path / "lists"):
        (base / "clips").mkdir(parents=True)
        touch(base / "clips/a.mp4")
    (tmp_path / "lists/meta.csv").write_text("video,prompt,person\nclips/a.mp4,a cat,refs/p.png\n")
    (tmp_path / "lists/train.jsonl").write_text("\n" + json.dumps({"path": "clips/a.mp4", "prompt": ""}) + "\n")
    els = [Element("person", [], False)]
    (s,), _ = discover(Dataset(data_root=str(tmp_path), dataset_type="csv", metadata_path="lists/meta.csv"), els)
    assert s.video == tmp_path / "lists/clips/a.mp4" and s.elements == {"person": tmp_path / "lists/refs/p.png"}
    assert s.prompt_source == f"{tmp_path / 'lists/meta.csv'} line 2"
    (s,), _ = discover(Dataset(data_root=str(tmp_path), dataset_type="csv", metadata_path="lists/meta.csv",
                               media_root=str(tmp_path)), els)
    assert s.video == tmp_path / "clips/a.mp4" and s.elements == {"person": tmp_path / "refs/p.png"}
    (s,), _ = discover(Dataset(data_root=str(tmp_path), dataset_type="jsonl", metadata_path="lists/train.jsonl"), els)
    assert s.video == tmp_path / "lists/clips/a.mp4" and s.prompt_source == f"{tmp_path / 'lists/train.jsonl'} line 2"


def test_folder_prompt_source_is_the_txt(tmp_path):
    touch(tmp_path / "001.mp4")
    (s,), _ = discover(Dataset(data_root=str(tmp_path)), [])
    assert s.prompt == "" and s.prompt_source == str(tmp_path / "001.txt")


def test_unreadable_metadata_names_file_line_and_fix(tmp_path):
    import pytest

    from e2v.data.sample import MetadataError

    def table(name, text=None, kind="jsonl"):
        if text is not None:
            (tmp_path / name).write_text(text)
        return Dataset(data_root=str(tmp_path), dataset_type=kind, metadata_path=name)

    with pytest.raises(MetadataError) as e:
        discover(table("missing.csv", kind="csv"), [])
    assert (e.value.file, e.value.problem) == (str(tmp_path / "missing.csv"), "metadata file does not exist")
    with pytest.raises(MetadataError) as e:
        discover(table("bad.jsonl", '{"path": "a.mp4", "prompt": "x"}\n{"path": "b.mp4", \n'), [])
    assert e.value.file == f"{tmp_path / 'bad.jsonl'} line 2" and e.value.problem.startswith("not JSON")
    with pytest.raises(MetadataError, match="line 1: a JSON list, not an object"):
        discover(table("list.jsonl", '["a.mp4", "x"]\n'), [])

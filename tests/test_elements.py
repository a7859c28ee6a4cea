from pathlib import Path

from e2v.config import Dataset, Element
from e2v.elements import discover, strip_caption_prefix


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

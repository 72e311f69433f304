
from gyre.proto.gen import REPO, generate


def test_checked_in_generated_code_is_fresh(tmp_path):
    for fresh in generate(tmp_path):
        checked_in = REPO / "proto" / fresh.name
        assert checked_in.is_file(), f"{checked_in} is missing; run `python -m gyre.proto.gen`"
        assert checked_in.read_text() == fresh.read_text(), f"{checked_in.name} is stale; run `python -m gyre.proto.gen`"

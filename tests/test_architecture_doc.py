"""docs/architecture.md's generated block matches the package tree, tests/test_layering.py's LAYERS and the
modules' docstrings (regenerate with ``python -m benchmarks architecture``)."""

from __future__ import annotations

import pytest

import benchmarks.architecture as arch


@pytest.fixture(scope="module")
def fresh() -> str:
    """The block as the tree makes it now (rendered once: it reads every module of the package)."""
    return arch.render()


def test_the_committed_architecture_page_is_current(fresh):
    committed = arch.generated_block(arch.DOC.read_text())
    assert committed is not None, f"{arch.DOC}: the generated block's markers are missing"
    if committed != fresh:
        added = sorted(set(fresh.splitlines()) - set(committed.splitlines()))
        gone = sorted(set(committed.splitlines()) - set(fresh.splitlines()))
        raise AssertionError(
            f"docs/architecture.md is stale: run `{arch.COMMAND}` and commit the result\n"
            + "".join(f"  + {line}\n" for line in added[:10])
            + "".join(f"  - {line}\n" for line in gone[:10])
        )


def test_every_part_of_the_package_has_a_row_and_a_rank(fresh, tmp_path):
    parts = arch.parts()
    ranks = arch.layering().LAYERS
    assert {"format", "codec", "kernels", "ops", "cache", "integrations", "cli"} <= set(parts)
    assert set(parts) <= set(ranks)
    block = fresh
    for name, files in parts.items():
        assert arch._where(name, files) in block, name
    # the rows follow the ranks: format before codec before ops before cli
    order = [block.index(f"`jetson_tq/{n}") for n in ("format.py", "codec/", "ops/", "cli/")]
    assert order == sorted(order)
    # write() only touches the block between the markers
    doc = tmp_path / "architecture.md"
    doc.write_text(f"intro\n{arch.BEGIN}\nold\n{arch.END}\noutro\n")
    assert arch.write(doc, block)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and arch.generated_block(text) == block

"""The README's offline-engine example runs as written and shows what it says it shows."""

from __future__ import annotations

import contextlib
import io

from readme import python_example

from loraserve.demo.styles import shows_style


def test_offline_engine_example_runs_and_batches_adapters_with_the_base_model():
    namespace: dict = {"__name__": "readme_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(python_example("Engine("), "README.md", "exec"), namespace)
    results = namespace["results"]
    assert [r.adapter for r in results] == ["rot13", None, "upper"]
    assert len(out.getvalue().splitlines()) == 3
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 24
    assert shows_style("rot13", results[0].text), results[0].text
    assert not shows_style("rot13", results[1].text), results[1].text

"""Where forward times come from: the formula, a similar model's stored table, this model's
stored table (spot-checked), the measured table; the two models measured level by level in
turn; a draft change that keeps the target's times."""

from __future__ import annotations

import json

import pytest
from support.engine import pair_kit

from server.engine.models.model_kit import ModelKit, load_model
from server.engine.speculation import forward_source
from server.engine.speculation.forward_prior import (
    DeviceSpeed,
    ModelSize,
    device_speed,
    formula_seconds,
    formula_times,
    scaled_to,
)
from server.engine.speculation.forward_source import CostSource, Origin, kit_variant
from server.engine.speculation.forward_store import TableStore, machine_key
from server.engine.speculation.forward_times import PROFILE_ROWS, ForwardTimes, time_forwards

# The tiny preset: 4 layers of q, k, v, o (64x64, 64x32, 64x32, 64x64), the MLP (3 x 64x128)
# and two norms; embeddings and head 512x64 each; the final norm.
TINY_PARAMETERS = 4 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128) + 2 * 32768 + 64


@pytest.fixture()
def target_only(tiny_pair) -> ModelKit:
    return ModelKit(load_model(str(tiny_pair[0])))


def test_the_formula_reads_the_weights_once_and_two_flops_per_parameter_per_token(tiny_pair):
    size = ModelSize.of(load_model(str(tiny_pair[0])).model)
    assert size == ModelSize(TINY_PARAMETERS, 4 * TINY_PARAMETERS, "float32")
    speed = DeviceSpeed("test", 0.002, 1e9, 1e10, 1e8)
    expected = 0.002 + 4 * TINY_PARAMETERS / 1e9 + 2 * TINY_PARAMETERS * 8 * 3 / 1e10
    assert formula_seconds(size, speed, 8, 3) == pytest.approx(expected)
    assert formula_times(size, speed).at(8, 3) == pytest.approx(expected)
    quantized = ModelSize(TINY_PARAMETERS, TINY_PARAMETERS // 2, "float32-q4")
    assert formula_seconds(quantized, speed, 8, 3) == pytest.approx(
        0.002 + TINY_PARAMETERS / 2 / 1e9 + 2 * TINY_PARAMETERS * 24 / 1e8)


def test_a_quantized_model_counts_the_values_its_weights_stand_for(quantized_pairs):
    for bits, (target, _) in quantized_pairs.items():
        size = ModelSize.of(load_model(str(target), dequantize=False).model)
        assert size.parameters == TINY_PARAMETERS and size.kind == f"float32-q{bits}"
        assert size.quantized and size.weight_bytes < 4 * TINY_PARAMETERS


def test_a_model_never_measured_serves_with_the_formula_then_its_measured_table(
        target_only, tmp_path):
    source = CostSource(target_only, tmp_path, budget_s=None)
    size = ModelSize.of(target_only.target.model)
    assert source.target.origin is Origin.FORMULA
    assert source.costs().target == formula_times(size, device_speed())
    assert source.status() == {"target": "formula", "draft": None, "measuring": True,
                               "measured_s": 0.0, "budget_s": None}
    changed = [source.step() for _ in range(1000) if source.pending]
    assert changed.count(True) == 1 and not source.pending
    assert source.target.origin is Origin.MEASURED
    assert source.costs().target == source.target.table
    assert source.target.table.rows == PROFILE_ROWS  # no bound: the whole grid
    assert source.status()["target"] == "measured" and source.status()["measured_s"] > 0


def test_forward_times_are_measured_once_per_model_and_machine(target_only, tmp_path,
                                                                monkeypatch):
    # A spot check of a stored table finds it measured while busy only when the machine is
    # now much faster: not the subject here (the next test's).
    monkeypatch.setattr(forward_source, "measured_busy", lambda check, table: False)
    first = CostSource(target_only, tmp_path, budget_s=None)
    first.finish()
    second = CostSource(target_only, tmp_path, budget_s=None)
    assert second.target.origin is Origin.STORED
    assert second.target.table == first.target.table
    second.finish()  # the spot check
    assert second.target.origin is Origin.STORED and len(list(tmp_path.iterdir())) == 1
    fused = ModelKit(target_only.target, fuse=True)  # another way of loading it: its own table
    assert CostSource(fused, tmp_path).target.origin is not Origin.STORED


def test_a_stored_table_measured_while_busy_is_measured_again(target_only, tmp_path):
    """A stored table at 10x the machine's times now (measured beside busy processes) fails
    the spot check and is measured again and stored; one at a tenth of them (measured when the
    machine was less busy than now) is kept."""
    loaded = target_only.target
    file = TableStore(tmp_path).path(machine_key(loaded.path, kit_variant(target_only, loaded)))
    now = time_forwards(loaded.model, (1, 8), (1, 2))

    def stored(scale: float) -> ForwardTimes:
        return now.scaled(scale)

    file.write_text(json.dumps(stored(0.1).to_json()))
    kept = CostSource(target_only, tmp_path)
    kept.finish()
    assert (kept.target.origin, kept.target.table) == (Origin.STORED, stored(0.1))
    file.write_text(json.dumps(stored(10.0).to_json()))
    again = CostSource(target_only, tmp_path)
    assert again.target.table == stored(10.0)
    again.finish()
    assert again.target.origin is Origin.MEASURED
    assert again.target.table.at(8, 1) < stored(10.0).at(8, 1)
    assert ForwardTimes.from_json(json.loads(file.read_text())) == again.target.table


def test_a_model_starts_from_the_stored_table_of_the_nearest_model_in_size(target_only,
                                                                           tmp_path):
    """A table of a model 1.5x the size (same kind, this machine) is scaled to this one: the
    formula's fixed cost stays, the rest shrinks by 1/1.5. One 3x the size, or of another
    kind, is not used."""
    size = ModelSize.of(target_only.target.model)
    store = TableStore(tmp_path)
    other = ForwardTimes((1, 8), (1, 2), ((0.010, 0.011), (0.020, 0.030)))
    bigger = ModelSize(int(size.parameters * 1.5), size.weight_bytes * 3 // 2, size.kind)
    store.save("other", other, bigger, "models/bigger")
    store.save("far", other.scaled(0.5), ModelSize(size.parameters * 3, 0, size.kind), "far")
    store.save("kind", other.scaled(0.9), ModelSize(size.parameters, 0, "float16"), "kind")
    source = CostSource(target_only, tmp_path)
    assert source.target.origin is Origin.SIMILAR
    speed = device_speed()
    assert source.target.table == scaled_to(other, bigger, size, speed)
    assert source.target.table.at(1, 1) == pytest.approx(
        speed.fixed_s + (0.010 - speed.fixed_s) * size.parameters / bigger.parameters)
    (tmp_path / "other.json").unlink()
    assert CostSource(target_only, tmp_path).target.origin is Origin.FORMULA


def test_the_two_models_are_measured_in_turn_level_by_level(tiny_pair, tmp_path):
    """Neither model gets more than one level ahead of the other, so a small budget measures
    both models' small batches before either's large ones."""
    source = CostSource(pair_kit(tiny_pair), tmp_path, budget_s=None)
    assert source.draft.origin is Origin.FORMULA
    while source.pending:
        source.step()
        if source.target.pending and source.draft.pending:
            assert abs(source.target.levels - source.draft.levels) <= 1
    assert source.status()["draft"] == "measured"
    assert source.costs().draft == source.draft.table


def test_a_new_draft_keeps_the_targets_times(tiny_pair, tmp_path):
    kit = pair_kit(tiny_pair)
    source = CostSource(kit, tmp_path, budget_s=None)
    source.finish()
    kit.load_draft(str(tiny_pair[1]))  # a new draft model object
    after = CostSource(kit, tmp_path, budget_s=None, previous=source)
    assert after.target is source.target and after.target.origin is Origin.MEASURED
    assert after.draft is not source.draft and after.draft.loaded is kit.draft
    assert after.draft.origin is Origin.STORED  # its folder's table, measured just before


def test_a_failed_measurement_keeps_the_prior_and_fails_nothing(target_only, tmp_path,
                                                                monkeypatch, caplog):
    class Failing(forward_source.ForwardTimer):
        def forwards(self):
            raise RuntimeError("out of memory")
            yield

    monkeypatch.setattr(forward_source, "ForwardTimer", Failing)
    source = CostSource(target_only, tmp_path)
    assert source.step() is False and not source.pending
    assert source.target.origin is Origin.FORMULA
    assert "measuring forward times failed; keeping the formula times" in caplog.text


def test_the_command_line_measures_stores_and_prints_the_tables(tiny_pair, capsys,
                                                                monkeypatch):
    """`python -m server.engine.speculation.cost_model`: measured (the whole grid) and stored
    the first time, read back the next, measured again with --remeasure. (The tiny models'
    forwards take a millisecond or two: a spot check would find a stored table measured while
    busy by timing noise alone. That check is `test_a_stored_table_measured_while_busy...`.)"""
    from server.engine.speculation import cost_model

    monkeypatch.setattr(forward_source, "measured_busy", lambda check, table: False)
    argv = ["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]), "--dtype",
            "float32"]  # a variant of its own: no other test stored its table
    outputs = []
    for extra in ([], [], ["--remeasure"]):
        cost_model.main(argv + extra)
        outputs.append(capsys.readouterr().out)
    assert "target (measured): ms per forward" in outputs[0] and "draft (measured)" in outputs[0]
    assert all(f"\n  {r:>4} " in outputs[0] for r in PROFILE_ROWS)
    assert "target (stored)" in outputs[1] and "draft (stored)" in outputs[1]
    assert "target (measured)" in outputs[2]

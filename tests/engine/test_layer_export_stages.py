"""graph_stage_layers: how a graph prefill's layers are staged for streaming (engine/layer_export.py).
Pure arithmetic: every layer in some stage, never more stages than GRAPH_STAGE_LAYERS allows nor than
the step's tokens pay for (one per GRAPH_TOKENS_PER_STAGE), at least one."""

from __future__ import annotations

import math

import pytest

from pd_ssm.engine.layer_export import GRAPH_STAGE_LAYERS, GRAPH_TOKENS_PER_STAGE, graph_stage_layers


@pytest.mark.parametrize("num_layers", [1, 7, 8, 9, 56, 64])
@pytest.mark.parametrize("tokens", [1, GRAPH_TOKENS_PER_STAGE - 1, GRAPH_TOKENS_PER_STAGE, 3 * GRAPH_TOKENS_PER_STAGE + 5,
                                    100 * GRAPH_TOKENS_PER_STAGE])
def test_stages_cover_the_layers_within_both_bounds(num_layers: int, tokens: int) -> None:
    per = graph_stage_layers(num_layers, tokens)
    stages = math.ceil(num_layers / per)
    assert 1 <= per <= num_layers
    assert stages <= max(1, tokens // GRAPH_TOKENS_PER_STAGE)
    assert stages <= math.ceil(num_layers / GRAPH_STAGE_LAYERS)


def test_long_steps_keep_the_full_staging_and_short_ones_one_stage() -> None:
    assert graph_stage_layers(64, 2048) == GRAPH_STAGE_LAYERS  # 2.7B, 2048 tokens: 8 stages of 8, as before
    assert graph_stage_layers(64, GRAPH_TOKENS_PER_STAGE) == 64  # one stage, behind the last layer's event
    assert graph_stage_layers(64, 2 * GRAPH_TOKENS_PER_STAGE) == 32

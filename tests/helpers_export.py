"""What tests/unit/test_export.py and tests/launch/test_export_runs.py share."""


def _from_original_wan(state: dict) -> dict:
    """diffusers' own original-Wan -> diffusers weight conversion (what its single-file loader runs)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    assert all(k.startswith("diffusion_model.") for k in state)
    return convert_wan_transformer_to_diffusers({k.removeprefix("diffusion_model."): v for k, v in state.items()})

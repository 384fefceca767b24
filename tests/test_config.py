import json

import pytest

from dsckpt.errors import ConfigError
from dsckpt.runtime.config import CONFIG_ENV_VAR, PRESETS, build_config, resolve_config


def test_presets_build_expected_stages_and_offload():
    assert set(PRESETS) == {"deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                            "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"}
    cfg = resolve_config(preset="deepspeed_stage_3_offload")
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    nvme = resolve_config(preset="deepspeed_stage_3_offload_nvme")
    assert nvme["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme"
    assert nvme["aio"]["queue_depth"] == 8
    assert resolve_config(preset="deepspeed_stage_1")["zero_optimization"]["stage"] == 1


def test_arguments_precision_buckets_and_activation_checkpointing():
    cfg = build_config(stage=2, precision="16", loss_scale=128, reduce_bucket_size=1000, partition_activations=True)
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 128, "initial_scale_power": 16, "loss_scale_window": 1000,
                           "hysteresis": 2, "min_loss_scale": 1}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1000
    assert cfg["activation_checkpointing"]["partition_activations"] is True
    assert build_config(stage=1, precision="bf16")["bf16"] == {"enabled": True}


def test_dict_file_and_env_sources(tmp_path, monkeypatch):
    user = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 4}
    assert resolve_config(user, preset="deepspeed_stage_3")["zero_optimization"]["stage"] == 1  # passed wins
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    assert resolve_config(str(path))["train_micro_batch_size_per_gpu"] == 4
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    assert resolve_config()["zero_optimization"]["stage"] == 1


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope.json: DeepSpeed config file not found"):
        resolve_config(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="clips by norm only"):
        resolve_config(preset="deepspeed", gradient_clip_val=1.0, gradient_clip_algorithm="value")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps is set both"):
        resolve_config({"gradient_accumulation_steps": 2}, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match="does not support precision '64'"):
        build_config(stage=3, precision="64")
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_config(preset="deepspeed_stage_9")


def test_more_than_one_optimizer_is_refused(monkeypatch):
    import torch

    import dsckpt.runtime.engine as eng

    monkeypatch.setattr(eng, "init_distributed", lambda: None)  # the check comes before any engine exists
    rt = eng.Runtime(build_config(stage=1))
    with pytest.raises(ConfigError, match="exactly one optimizer, got 2"):
        rt.setup(lambda: torch.nn.Linear(2, 2), lambda ps: [torch.optim.SGD(ps, lr=1), torch.optim.SGD(ps, lr=1)])


def test_train_options_reach_the_config():
    from dsckpt.runtime.train import TrainOptions

    cfg = TrainOptions(stage=3, precision="bf16", offload_optimizer=True, offload_parameters=True,
                       gradient_accumulation_steps=4, gradient_clip_val=1.0).deepspeed_config()
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["gradient_clipping"] == 1.0 and cfg["bf16"]["enabled"]
    assert TrainOptions().deepspeed_config()["zero_optimization"]["stage"] == 3  # the default: ZeRO-3
    preset = TrainOptions(preset="deepspeed_stage_2_offload", offload_optimizer=False).deepspeed_config()
    assert "offload_optimizer" not in preset["zero_optimization"]  # an explicit flag beats the preset


def test_config_files_that_are_not_json_objects_get_one_typed_error_each(tmp_path, monkeypatch):
    """One JSON reader (formats.json_file) for DeepSpeed and Hugging Face configs: each broken invariant is named."""
    from dsckpt.errors import LimitExceededError
    from dsckpt.export.hf import read_json
    from dsckpt.runtime.config import load_config

    bad, listed, ok = tmp_path / "bad.json", tmp_path / "list.json", tmp_path / "ok.json"
    bad.write_text("{not json")
    listed.write_text("[1, 2]")
    ok.write_text('{"train_batch_size": 4}')
    with pytest.raises(ConfigError, match=r"bad.json: not a readable JSON DeepSpeed config \(Expecting"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"list.json: JSON DeepSpeed config must be a JSON object"):
        load_config(listed)
    with pytest.raises(ConfigError, match=r"list.json: JSON file must be a JSON object"):
        read_json(listed)
    assert load_config(ok) == read_json(ok) == {"train_batch_size": 4}
    monkeypatch.setenv("DSCKPT_MAX_JSON_BYTES", "10")
    with pytest.raises(LimitExceededError, match=r"ok.json: the size of this JSON DeepSpeed config is 23, above the limit of 10"):
        load_config(ok)


def test_model_factory_from_a_module_in_the_current_folder(tmp_path, monkeypatch):
    """#69.4: `--model mymodule:build` finds mymodule.py in the folder the command runs from (as `python -m` does);
    a module found nowhere gets a hint that says where it was looked for."""
    import sys

    import pytest
    import torch

    from dsckpt.errors import ConfigError
    from dsckpt.runtime.train import load_factory

    (tmp_path / "mymodule_for_dsckpt.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    model = load_factory("mymodule_for_dsckpt:build")()
    assert isinstance(model, torch.nn.Linear) and model.weight.shape == (2, 3)
    with pytest.raises(ConfigError) as err:
        load_factory("no_such_module_anywhere:build")
    assert "neither an installed package nor a .py file in" in (err.value.hint or "") and str(tmp_path) in err.value.hint

"""BatchPlan: the worked example, the TRL mapping, every impossible combination, and the split-group warning."""

import itertools
import warnings

import pytest

from trl_multiturn.batching import BatchPlan


def no_warning(*args, **kwargs) -> BatchPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return BatchPlan(*args, **kwargs)


def test_worked_example_256x5_mini128_micro32():
    # 256 prompts x 5 samples = 1280 trajectories; 1280 / 128 = 10 optimizer steps; 128 / (32 x 1) = 4 accumulation
    with pytest.warns(UserWarning, match="mini_batch_size=128 is not a multiple of num_generations=5"):
        plan = BatchPlan(train_batch_size=256, num_generations=5, mini_batch_size=128, micro_batch_size=32)
    assert plan.trajectories_per_rollout == 1280
    assert plan.mini_batches_per_rollout == plan.optimizer_steps_per_rollout == 10
    assert plan.gradient_accumulation_steps == 4
    assert plan.micro_batches_per_rollout == 40  # 10 steps x 4 accumulation
    assert not plan.whole_groups_per_mini_batch
    # TRL: generation_batch_size = per_device_train_batch_size * world * steps_per_generation = 32 * 1 * 40 = 1280
    assert plan.trl_kwargs() == {
        "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 4,
        "steps_per_generation": 40,
        "num_iterations": 1,
        "num_generations": 5,
    }
    text = plan.describe()
    assert "256 prompts x 5 samples = 1280 trajectories" in text
    assert "10 mini-batches of 128 trajectories" in text
    assert "4 accumulation step(s) x 1 device(s) x micro-batch of 32" in text
    assert "steps_per_generation=40" in text and "not a multiple of num_generations=5" in text
    assert text.index("rollout") < text.index("mini-batches") < text.index("micro-batch")


def test_multi_device_multi_epoch_plan():
    # 64 x 8 = 512 trajectories; 512 / 128 = 4 mini-batches x 2 epochs = 8 optimizer steps;
    # 128 / (8 x 4 devices) = 4 accumulation steps; 512 / (8 x 4) = 16 micro-steps per device per epoch
    plan = no_warning(64, 8, 128, 8, ppo_epochs=2, world_size=4)
    assert (plan.mini_batches_per_rollout, plan.optimizer_steps_per_rollout) == (4, 8)
    assert plan.gradient_accumulation_steps == 4 and plan.whole_groups_per_mini_batch
    kw = plan.trl_kwargs()
    assert kw["steps_per_generation"] == 16 and kw["num_iterations"] == 2
    assert "2 PPO epoch(s)" in plan.describe() and "note:" not in plan.describe()


def test_derived_counts_agree_with_trl_identities():
    valid = 0
    for B, G, mini, micro, epochs, world in itertools.product(
        [1, 3, 16], [2, 5, 8], [8, 16, 40, 48], [1, 2, 4, 8], [1, 3], [1, 2]
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = BatchPlan(B, G, mini, micro, epochs, world)
        except ValueError:
            continue  # the error paths are tested below
        valid += 1
        kw = plan.trl_kwargs()
        # TRL's generation batch is exactly one rollout
        assert kw["per_device_train_batch_size"] * world * kw["steps_per_generation"] == B * G
        # one optimizer step = one mini-batch
        assert kw["per_device_train_batch_size"] * world * kw["gradient_accumulation_steps"] == mini
        # TRL micro-steps between generations / accumulation = optimizer steps per rollout
        steps = kw["steps_per_generation"] * kw["num_iterations"] // kw["gradient_accumulation_steps"]
        assert steps == plan.optimizer_steps_per_rollout == B * G * epochs // mini
        assert kw["steps_per_generation"] % kw["gradient_accumulation_steps"] == 0
    assert valid > 50  # the grid exercises many valid plans


def test_mini_not_divisible_names_knobs_and_a_valid_choice():
    with pytest.raises(ValueError) as err:
        BatchPlan(256, 5, 300, 32)
    msg = str(err.value)
    assert "train_batch_size=256 x num_generations=5 = 1280" in msg and "mini_batch_size=300" in msg
    assert "[32, 64, 128, 160, 256, 320, 640, 1280]" in msg and "nearest 320" in msg
    no_warning(256, 5, 320, 32)  # the suggestion works (and keeps whole groups)


def test_micro_times_world_larger_than_mini():
    with pytest.raises(ValueError, match=r"micro_batch_size=64 x world_size=4 = 256 .*exceeds mini_batch_size=128.*32"):
        BatchPlan(256, 5, 128, 64, world_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert BatchPlan(256, 5, 128, 32, world_size=4).gradient_accumulation_steps == 1


def test_mini_not_divisible_by_micro_times_world():
    with pytest.raises(ValueError, match=r"mini_batch_size=160 is not divisible by micro_batch_size=6 x world_size=1"):
        BatchPlan(256, 5, 160, 6)
    with pytest.raises(ValueError, match=r"Valid micro_batch_size values: \[1, 2, 4, 5, 8, 10, 20, 40\].*nearest 5"):
        BatchPlan(256, 5, 160, 6, world_size=4)  # divisors of 160 / 4 = 40


def test_mini_larger_than_rollout():
    with pytest.raises(ValueError, match=r"mini_batch_size=2048 is larger than one rollout .* 1280 trajectories"):
        BatchPlan(256, 5, 2048, 32)


def test_fewer_than_two_generations():
    with pytest.raises(ValueError, match=r"num_generations=1.*num_generations >= 2"):
        BatchPlan(256, 1, 128, 32)


@pytest.mark.parametrize("knob", ["train_batch_size", "num_generations", "mini_batch_size", "micro_batch_size",
                                  "ppo_epochs", "world_size"])
@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_non_positive_or_non_int(knob, bad):
    kwargs = dict(train_batch_size=16, num_generations=4, mini_batch_size=16, micro_batch_size=4)
    kwargs[knob] = bad
    with pytest.raises(ValueError, match=rf"{knob}={bad!r} must be a positive int"):
        BatchPlan(**kwargs)


def test_split_groups_warn_with_whole_group_alternatives():
    with pytest.warns(UserWarning, match=r"mini_batch_size in \[40, 80, 160, 320\]"):
        BatchPlan(64, 5, 32, 8)  # 320 trajectories; lcm(5, 8) = 40
    plan = no_warning(64, 5, 40, 8)
    assert plan.whole_groups_per_mini_batch and plan.gradient_accumulation_steps == 5


# ---------------------------------------------------------------------------------------------------- micro-batch packing
def test_balanced_partition_groups_similar_lengths():
    from trl_multiturn.batching import balanced_partition

    # sorted longest first: 10, 9 | 2, 1 -> padded sizes 2*10 = 20 and 2*2 = 4 (vs 2*10 + 2*9 mixing long and short)
    assert balanced_partition([10, 9, 2, 1], 2) == [[0, 1], [2, 3]]
    # one very long row gets a part of its own; the seven short rows share the other (padded 1*100 and 7*1)
    assert balanced_partition([100, 1, 1, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert balanced_partition([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="non-empty micro-batches"):
        balanced_partition([1, 2], 3)


def test_balanced_partition_properties_and_padding():
    import random

    from trl_multiturn.batching import balanced_partition

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 24)
        k = rng.randint(1, n)
        lengths = [rng.randint(1, 64) for _ in range(n)]
        parts = balanced_partition(lengths, k)
        assert len(parts) == k and all(parts) and sorted(sum(parts, [])) == list(range(n))
        padded = sum(len(p) * max(lengths[i] for i in p) for p in parts)
        # never more padding than fixed-size consecutive chunks of the unsorted rows (the plain split) when n % k == 0
        if n % k == 0:
            size = n // k
            plain = sum(size * max(lengths[j * size : (j + 1) * size]) for j in range(k))
            assert padded <= plain


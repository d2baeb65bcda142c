"""Recipe checks across sections: combinations of keys that each validate alone but
cannot work together (errors) or probably do not do what was meant (warnings).

``asyncrl check`` and ``asyncrl up`` both run them before anything starts. Like
:mod:`asyncrl.config.recipe`, this module imports no torch.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.config.placement import (
    ROLES,
    assign_gpus,
    describe_gpus,
    gpu_device,
    gpu_problems,
    gpus_needed,
    local_processes,
    node_placement_problems,
)
from asyncrl.config.recipe import (
    HFData,
    JsonlData,
    Recipe,
    RecipeError,
    image_field,
    path_problems,
)
from asyncrl.config.recipe import generation_budget as generation_budget
from asyncrl.config.schema import engine_device
from asyncrl.data import missing_fields, read_jsonl
from asyncrl.models.resolve import SMOLLM2_NAME, TINY_NAME
from asyncrl.models.vision import vision_family_offline
from asyncrl.runtime.cores import gpu_visible, is_cpu_device, node_gpus
from asyncrl.weights.choose import choose as choose_transport
from asyncrl.weights.choose import transport_problems


def recipe_problems(recipe: Recipe) -> tuple[list[str], list[str]]:
    """Combinations of keys from different sections that cannot work (errors) or that
    probably do not do what was meant (warnings). Each line names its keys."""
    errors: list[str] = []
    warnings: list[str] = []
    r, t, loss = recipe.rollout, recipe.trainer, recipe.trainer.loss
    if r.group_size == 1:
        g1 = "rollout.group_size = 1 with"
        if loss.adv_std_level == "group":
            errors.append(
                f'{g1} trainer.loss.adv_std_level = "group": a one-sample group has no std'
            )
        if loss.leave_one_out:
            errors.append(
                f"{g1} trainer.loss.leave_one_out = true: RLOO's baseline needs a second "
                "sample in the group"
            )
        if recipe.buffer.dynamic_filter:
            errors.append(
                f"{g1} buffer.dynamic_filter = true: a one-sample group always has equal "
                "rewards, so every group is dropped and no batch ever forms"
            )
        if not errors:
            errors.append(
                "rollout.group_size = 1: the group-mean baseline makes every advantage 0; "
                "use at least 2 samples per prompt"
            )
    budget = generation_budget(recipe)
    budget_keys = r.workflow.budget_keys()
    if loss.norm_len is not None:
        if loss.loss_agg != "seq-mean-token-sum-norm":
            warnings.append(
                f"trainer.loss.norm_len is ignored by trainer.loss.loss_agg = "
                f'"{loss.loss_agg}" (only seq-mean-token-sum-norm divides by it)'
            )
        elif loss.norm_len < budget:
            errors.append(
                f"trainer.loss.norm_len = {loss.norm_len:g} is below the generation budget "
                f"({budget_keys} = {budget} tokens): Dr.GRPO's divisor must "
                "be a constant no answer exceeds; leave it unset for the budget"
            )
    n_seqs = recipe.buffer.batch_size * r.group_size
    if t.ppo_minibatches > n_seqs:
        errors.append(
            f"trainer.ppo_minibatches = {t.ppo_minibatches} exceeds the {n_seqs} sequences of "
            "a batch (buffer.batch_size × rollout.group_size)"
        )
    if t.shaping.overlong_buffer > budget:
        errors.append(
            f"trainer.shaping.overlong_buffer = {t.shaping.overlong_buffer} exceeds the "
            f"generation budget ({budget_keys} = {budget} tokens)"
        )
    for key, n, role in (
        ("rollout.actors", r.actors, "rollout"),
        ("reward.actors", recipe.reward.actors, "reward"),
    ):
        if n == 0:
            warnings.append(
                f"{key} = 0: nothing {'generates' if role == 'rollout' else 'scores'} until "
                f"a {role} actor is attached (asyncrl attach {role} --run <run folder>)"
            )
    if r.colocate and r.engine.type == "vllm":
        errors.append(
            'rollout.colocate = true with rollout.engine.type = "vllm": the vllm engine '
            'cannot release its memory for a trainer step; use "sglang" or "hf"'
        )
    s = r.sampling
    if (s.top_p < 1 or s.top_k > 0) and r.engine.type == "sglang":
        errors.append(
            f'rollout.engine.type = "sglang" with rollout.sampling.top_p = {s.top_p:g} / '
            f"top_k = {s.top_k}: SGLang reports the logprob of the temperature-scaled "
            "distribution before the cut, while the trainer (like the hf and vllm engines) "
            "uses the cut, renormalised distribution that sampled, so every importance "
            'weight would be biased; set top_p = 1 and top_k = 0, or use "vllm" or "hf"'
        )
    errors.extend(kl_problems(recipe))
    errors.extend(lora_problems(recipe))
    errors.extend(workflow_problems(recipe))
    errors.extend(vision_problems(recipe))
    errors.extend(endpoint_sampling_problems(recipe))
    det_errors, det_warnings = determinism_problems(recipe)
    errors += det_errors
    warnings += det_warnings
    loss = t.loss
    if loss.kl_coef > 0 and loss.kl_type == "k3" and loss.kl_in == "loss":
        warnings.append(
            'trainer.loss.kl_type = "k3" with trainer.loss.kl_in = "loss": the expected '
            "gradient is that of the reverse KL, KL(π_ref ‖ π) (as in GRPO), not of "
            'KL(π ‖ π_ref); kl_type = "k2" gives the latter'
        )
    k, eta = t.update_every, recipe.buffer.max_head_offpolicyness
    if k > 1:
        warnings.append(
            f"trainer.update_every = {k} with buffer.max_head_offpolicyness = {eta}: "
            "staleness is judged against the published weights, which lag the trainer by "
            f"up to {k - 1} steps, so a trained sample may be up to η + k − 1 = {eta + k - 1} "
            f"trainer versions old (η = {eta} bounds published versions)"
        )
    if t.lm_head_precision == "tf32" and t.device == "cpu":
        warnings.append(
            'trainer.lm_head_precision = "tf32" with trainer.device = "cpu": TF32 is a CUDA '
            "tensor-core format; the CPU computes the LM head in float32 whatever it says"
        )
    if t.nproc > 1 and t.device.startswith("cuda:"):
        errors.append(
            f'trainer.device = "{t.device}" with trainer.nproc = {t.nproc}: every rank would '
            'share one GPU; use "cuda" (each rank on its own, cuda:LOCAL_RANK) or nproc = 1'
        )
    errors.extend(trainer_node_problems(recipe))
    errors.extend(node_placement_problems(recipe))
    errors.extend(gpu_problems(recipe))
    errors.extend(transport_problems(recipe))
    if recipe.model.gguf_file and r.engine.type != "instant":
        warnings.append(
            f"model.gguf_file = {recipe.model.gguf_file!r} is loaded by the trainer only: "
            f'the "{r.engine.type}" rollout engines sample from model.path\'s own weights '
            "until the first weight update"
        )
    if r.engine.type == "instant" and t.mismatch_limit is not None:
        warnings.append(
            'rollout.engine.type = "instant" with trainer.mismatch_limit set: its logprobs '
            "(-1.0) are no model's, so a real trainer's version-0 gate stops the run; "
            "trainer.mismatch_limit = null turns the gate off"
        )
    warnings.extend(listen_warnings(recipe))
    warnings.extend(shared_core_warnings(recipe))
    nats_errors, nats_warnings = nats_problems(recipe)
    errors += nats_errors
    warnings += nats_warnings
    return errors, warnings


def trainer_node_problems(recipe: Recipe) -> list[str]:
    """A trainer across nodes that cannot start: a rendezvous for one node, one GPU per
    node process, or several nodes on one machine sharing its GPUs."""
    t, errors = recipe.trainer, []
    if t.rendezvous and t.nodes == 1:
        errors.append(
            f"trainer.rendezvous = {t.rendezvous!r} with trainer.nodes = 1: a rendezvous "
            "joins several trainer nodes; leave it empty or raise trainer.nodes"
        )
    if t.nodes > 1 and t.device.startswith("cuda:"):
        errors.append(
            f'trainer.device = "{t.device}" with trainer.nodes = {t.nodes}: each node\'s '
            'ranks take cuda:LOCAL_RANK; use "cuda"'
        )
    if t.nodes > 1 and not t.rendezvous and t.device == "cuda":
        errors.append(
            f"trainer.nodes = {t.nodes} with trainer.rendezvous empty puts every trainer node "
            'on this machine, where trainer.device = "cuda" would give each node the same '
            "GPUs (cuda:LOCAL_RANK); on one machine use trainer.nproc for its GPUs, or "
            'trainer.device = "cpu"'
        )
    return errors


def lora_problems(recipe: Recipe) -> list[str]:
    """LoRA settings that a rollout engine cannot serve."""
    lora, engine = recipe.trainer.lora, recipe.rollout.engine.type
    if not lora.publishes_adapter:
        return []
    if engine == "vllm" and lora.rank > 512:
        return [
            f'trainer.lora.rank = {lora.rank} with rollout.engine.type = "vllm": vLLM '
            "serves adapters up to rank 512; lower the rank, or set "
            'trainer.lora.publish = "merged"'
        ]
    return []


def kl_problems(recipe: Recipe) -> list[str]:
    """KL placements whose expected gradient is no KL's (see
    :func:`asyncrl.algo.loss.kl_penalty`): k1 in the loss (zero), k2 or k3 in the reward.
    Refused with the penalty off too: a recipe that names a placement that cannot work is
    a mistake waiting for ``kl_coef`` to be raised."""
    loss = recipe.trainer.loss
    keys = f'trainer.loss.kl_type = "{loss.kl_type}" with trainer.loss.kl_in = "{loss.kl_in}"'
    if loss.kl_type == "k1" and loss.kl_in == "loss":
        return [
            f"{keys}: k1's expected gradient in the loss is 0 (E_π[∇log π] = 0), so the "
            'penalty does nothing; set kl_in = "reward" (k1 as a reward gives '
            '∇KL(π ‖ π_ref)) or kl_type = "k2" (exact in the loss)'
        ]
    if loss.kl_type != "k1" and loss.kl_in == "reward":
        return [
            f"{keys}: as a reward only k1's policy gradient is that of KL(π ‖ π_ref) "
            f"({loss.kl_type}'s is biased; k3's nearly vanishes near π_ref); set "
            'kl_type = "k1", or kl_in = "loss" (k2: ∇KL(π ‖ π_ref), k3: ∇KL(π_ref ‖ π))'
        ]
    return []


def workflow_problems(recipe: Recipe) -> list[str]:
    """A workflow that cannot be built, each line naming its key: the workflow's own checks
    (:meth:`~asyncrl.config.workflow.WorkflowConfigBase.problems`; they load the recipe's
    code)."""
    return recipe.rollout.workflow.problems(recipe.rollout)


def vision_problems(recipe: Recipe) -> list[str]:
    """Images in the prompts (``data`` or ``eval.data`` whose records name image files)
    need a vision model, an engine that feeds it images and a workflow that puts them in
    the prompt; a vision model generating text-only prompts is fine."""
    errors: list[str] = []
    keys = [
        (section, key)
        for section, source in (("data", recipe.data), ("eval.data", recipe.eval.data))
        if (key := image_field(source))
    ]
    if not keys:
        return errors
    named = " and ".join(f"{section} (field {key!r})" for section, key in keys)
    model = recipe.model.path
    if vision_family_offline(model) is None:
        errors.append(
            f"{named} names images, but model.path = {model!r} is not a vision model known "
            "here (Qwen2-VL, Qwen2.5-VL, Idefics3/SmolVLM, or tiny-random-qwen2-vl / "
            "tiny-random-idefics3)"
        )
    engine = recipe.rollout.engine.type
    why = {
        "sglang": "SGLang's CPU server does not take image inputs",
        "vllm": "the vllm backend sends token ids without their images",
    }.get(engine)
    if why:
        errors.append(
            f'{named} names images: rollout.engine.type = "{engine}" cannot serve them '
            f'({why}); use "hf"'
        )
    t = recipe.trainer
    if t.nproc * t.nodes > 1:
        errors.append(
            f"{named} names images: trainer.nproc × trainer.nodes = {t.nproc * t.nodes} "
            "ranks; a vision model trains on one rank for now (a rank whose micro-batch has "
            "no image would skip the vision tower's collectives)"
        )
    if t.share_prefix is True:
        errors.append(
            f"{named} names images: trainer.share_prefix = true cannot apply (a sample's "
            'positions and image features are its own); set "auto" or false'
        )
    workflow = recipe.rollout.workflow.spec()
    if workflow != "rlvr":
        errors.append(
            f"{named} names images: rollout.workflow = {workflow!r} does not put them in "
            'the prompt; use "rlvr"'
        )
    return errors


def endpoint_sampling_problems(recipe: Recipe) -> list[str]:
    """``rollout.endpoint_sampling = "per_call"`` with a workflow whose samples never come
    from the endpoint's calls: the key would do nothing there, which is a mistake about
    what the workflow does."""
    r = recipe.rollout
    if r.endpoint_sampling != "per_call" or r.workflow.calls_endpoint(r):
        return []
    return [
        f'rollout.endpoint_sampling = "per_call" with rollout.workflow = {r.workflow.spec()!r}: '
        "this workflow samples on the engine with rollout.sampling, never through the "
        'endpoint, so no call chooses its sampling; leave the key out ("recipe"). It is '
        "for agent code, verifiers environments, and an episode workflow handed the "
        "endpoint (rollout.endpoint = true)"
    ]


SERVER_BATCHING = (
    "its server batches whatever requests are in flight together (continuous batching, "
    "a shared prefix cache, kernels chosen by batch size), so a sample's logits depend on "
    "the other sequences of its batch and a seed fixes only the draw; asyncrl cannot run "
    "a server's sequences alone, nor check that its kernels are batch-invariant"
)
"""Why a server engine cannot make ``rollout.deterministic`` hold."""


def determinism_problems(recipe: Recipe) -> tuple[list[str], list[str]]:
    """``rollout.deterministic`` where it cannot hold (errors): a server engine, whose
    batches asyncrl does not control, or a workflow whose samples come from endpoint
    calls, which carry no sample index to seed them by; and where it holds only in part
    (warnings): η > 0, user episode code."""
    r = recipe.rollout
    if not r.deterministic:
        return [], []
    errors: list[str] = []
    warnings: list[str] = []
    if r.engine.type in ("vllm", "sglang"):
        errors.append(
            f'rollout.deterministic = true with rollout.engine.type = "{r.engine.type}": '
            f'{SERVER_BATCHING}; use "hf", which runs each sequence alone'
        )
    if r.workflow.needs_endpoint:
        errors.append(
            f"rollout.deterministic = true with rollout.workflow = {r.workflow.spec()!r}: "
            "its samples come from calls to the endpoint, which do not say which sample "
            "of the group they belong to, so they cannot be seeded by it (every call would "
            "get the one seed of rollout.sampling, and a group identical samples)"
        )
    elif r.workflow.type == "episode":
        warnings.append(
            f"rollout.deterministic = true with rollout.workflow = {r.workflow.spec()!r}: "
            "its code makes its own requests; they repeat only if each carries a seed from "
            "its sample (asyncrl.workflows.rlvr.sample_seed(sampling.seed, uid, index, "
            "attempt), from the item's uid and attempt), and the endpoint's calls never do"
        )
    eta = recipe.buffer.max_head_offpolicyness
    if eta > 0:
        warnings.append(
            f"rollout.deterministic = true with buffer.max_head_offpolicyness = {eta}: each "
            "sample is seeded and computed alone, but which weights it meets (an update "
            "may land in mid-episode), and which groups make a batch, depend on timing; "
            "only η = 0 makes two runs of one seed train the same weights"
        )
    return errors, warnings


def data_problems(recipe: Recipe) -> list[str]:
    """Rows of the run's local JSONL data (``data``, ``eval.data``) that lack the field
    the recipe reads the question or the answer from: found here, each is an error
    before anything starts rather than a buffer or eval actor that dies at its start.
    Hub datasets are left to the actors: reading one here could mean a download. A file
    that is not here is :func:`asyncrl.config.recipe.path_problems`' to report."""
    errors: list[str] = []
    for section, source in (("data", recipe.data), ("eval.data", recipe.eval.data)):
        if not isinstance(source, JsonlData) or not Path(source.path).expanduser().is_file():
            continue
        try:
            rows = read_jsonl(source.path)
        except (OSError, ValueError) as exc:
            errors.append(f"{section}.path: {exc}")
            continue
        keys = {source.prompt_key: "prompt_key", source.answer_key: "answer_key"}
        for key, name in keys.items():
            lacking = [i for i, _ in missing_fields(rows, [key])]
            if lacking:
                shown = ", ".join(map(str, lacking[:5])) + (", ..." if len(lacking) > 5 else "")
                errors.append(
                    f"{section}.{name} = {key!r}: {len(lacking)} of the {len(rows)} rows of "
                    f"{source.path} lack it (rows {shown})"
                )
    return errors


LOOPBACK_HOSTS = ("127.", "::1", "localhost")


def shared_core_warnings(recipe: Recipe) -> list[str]:
    """Roles pinned by hand (``<role>.cpus``) to cores they share, each running more than
    one torch thread there. Two thread pools on the same cores wait on each other's
    threads at every parallel region: on a 16-core Xeon a trainer with 16 threads on all
    cores, 4 of them shared with generation's 4 threads, took 24-144 s a step against
    4.0-4.3 s on the other 12 (:mod:`asyncrl.launch.core_placement`). Only roles computing on this
    machine's CPU count; a role's threads are its ``threads`` key, else its cores (torch's
    default on a pinned process), a trainer's shared among its ranks."""
    r, e, t = recipe.rollout, recipe.eval, recipe.trainer
    pools: dict[str, tuple[set[int], int]] = {}
    engine_cpu = r.engine.type == "hf" and is_cpu_device(engine_device(r.engine))
    if engine_cpu and r.cpus:
        pools["rollout"] = (set(r.cpus), r.threads or len(set(r.cpus)))
    if engine_cpu and e.every and e.cpus:
        pools["eval"] = (set(e.cpus), e.threads or len(set(e.cpus)))
    if is_cpu_device(t.device) and t.cpus:
        pools["trainer"] = (set(t.cpus), t.threads or max(1, len(set(t.cpus)) // t.nproc))
    warnings = []
    roles = list(pools)
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            (cores_a, n_a), (cores_b, n_b) = pools[a], pools[b]
            shared = sorted(cores_a & cores_b)
            if shared and n_a > 1 and n_b > 1:
                warnings.append(
                    f"{a}.cpus and {b}.cpus share cores {shared}, where {a} runs {n_a} and "
                    f"{b} {n_b} torch threads: two thread pools on the same cores wait on "
                    f"each other (steps many times slower); give them disjoint cores or one "
                    f"of them {b if b == 'eval' else a}.threads = 1"
                )
    return warnings


def listen_warnings(recipe: Recipe) -> list[str]:
    """What an embedded server open to other machines (``run.listen``) probably lacks."""
    run = recipe.run
    if not run.listen or run.listen.startswith(LOOPBACK_HOSTS) or run.listen.startswith("[::1]"):
        return []
    warnings = []
    if not run.tls_cert:
        warnings.append(
            f"run.listen = {run.listen!r} without run.tls_cert: the run's token and messages "
            "cross the network in clear text; give --tls-cert/--tls-key on a network you "
            "do not trust"
        )
    if choose_transport(recipe)[0] == "dir":
        warnings.append(
            f'run.listen = {run.listen!r} with weights.transport = "dir": actors on '
            "other machines can load new weights only if they see the run folder at the "
            'same path (a shared file system); "object_store" sends weights through NATS'
        )
    return warnings


def nats_problems(recipe: Recipe) -> tuple[list[str], list[str]]:
    """A replica count the run's NATS servers cannot hold (errors), or may not (warnings:
    the URLs of an external cluster need not name every server)."""
    run = recipe.run
    if run.nats_replicas == 1:
        return [], []
    if not run.nats_url:
        if run.nats_replicas > run.nats_servers:
            return [
                f"run.nats_replicas = {run.nats_replicas} exceeds run.nats_servers = "
                f"{run.nats_servers}: each replica lives on its own server; start as many "
                f"servers (run.nats_servers = {run.nats_replicas}) or lower the replicas"
            ], []
        return [], []
    n = len([u for u in run.nats_url.split(",") if u.strip()])
    if run.nats_replicas > n:
        return [], [
            f"run.nats_replicas = {run.nats_replicas} with {n} server(s) in run.nats_url: "
            f"the cluster needs at least {run.nats_replicas} servers with JetStream, or "
            "the run's stream cannot be created; list them all in run.nats_url"
        ]
    return [], []


CPU_WAY = (
    "on a CPU, run the quickstart (make run: asyncrl up recipes/quickstart.toml), or this "
    "recipe with --set trainer.device=cpu --set rollout.engine.type=hf "
    "--set rollout.engine.device=cpu (the README's GSM8K on a CPU)"
)


def machine_problems(recipe: Recipe, gpus: list[str], cuda: bool) -> list[str]:
    """Why the recipe cannot run on this machine, which gives its processes the GPUs
    ``gpus`` (:func:`asyncrl.runtime.cores.node_gpus`) and where ``cuda`` says whether any GPU is
    visible (:func:`asyncrl.runtime.cores.gpu_visible`): a role set to a CUDA device (``cuda``,
    ``cuda:N``) where there is none, or roles that take more GPUs (``<role>.gpus``) than
    the machine has. ``asyncrl up`` refuses these before it starts anything."""
    errors: list[str] = []
    counts = local_processes(recipe)
    if not cuda:
        devices = {
            found
            for role in ROLES
            if counts[role] and (found := gpu_device(recipe, role)) is not None
        }
        errors += [
            f'{key} = "{device}" but this machine has no GPU (no /dev/nvidia* device, or '
            "CUDA_VISIBLE_DEVICES hides them)"
            for key, device in sorted(devices)
            if device.startswith("cuda")
        ]
    sets = assign_gpus(recipe)
    needed = gpus_needed(sets)
    if needed > len(gpus):
        errors.append(
            f"the roles take {needed} GPUs ({describe_gpus(sets)}; <role>.gpus per process, "
            f"× trainer.nproc for the trainer) but this machine has {len(gpus)}"
            f"{' (CUDA_VISIBLE_DEVICES)' if gpus else ''}; lower <role>.gpus or the number "
            "of processes"
        )
    if errors and not cuda:
        errors.append(CPU_WAY)
    return errors


def enforce_machine(recipe: Recipe) -> list[str]:
    """Raises :class:`RecipeError` listing :func:`machine_problems` for this machine;
    returns the GPUs it has, which ``up`` hands out (:func:`asyncrl.config.placement.assign_gpus`)."""
    gpus = node_gpus()
    errors = machine_problems(recipe, gpus, gpu_visible())
    if errors:
        raise RecipeError("recipe cannot run here:\n" + "\n".join(f"  {e}" for e in errors))
    return gpus


def check_report(recipe: Recipe, nodes: int | None) -> tuple[list[str], list[str]]:
    """What ``asyncrl check`` verified, and what it could not verify here, one line each.
    With ``nodes`` (``--nodes``, a Slurm job) the run starts on the cluster, so this
    machine's files and GPUs say nothing about it: a missing local path, the node's GPU
    count (unless a ``[nodes.*]`` table declares it) and CUDA go to the second list; so
    do, always, the model and datasets read from the HF hub (never fetched by ``check``)."""
    verified = ["every key and value", "the combinations across sections"]
    unverified = list(path_problems(recipe)) if nodes is not None else []
    if nodes is not None:
        verified.append(f"the placement on {nodes} Slurm node(s)")
    local = [
        f"{key}.path {source.path!r}"
        for key, source in (("data", recipe.data), ("eval.data", recipe.eval.data))
        if isinstance(source, JsonlData) and Path(source.path).expanduser().is_file()
    ]
    if local:
        verified.append(f"the rows of {', '.join(local)}")
    model = recipe.model.path
    if model not in (SMOLLM2_NAME, TINY_NAME) and not Path(model).expanduser().is_dir():
        if not model.startswith((".", "/", "~")):
            unverified.append(f"model.path = {model!r}: a hub id, fetched where the run starts")
    for key, source in (("data", recipe.data), ("eval.data", recipe.eval.data)):
        if isinstance(source, HFData):
            subset = f", {source.subset}" if source.subset else ""
            unverified.append(
                f"{key}: {source.name} ({source.split}{subset}) from the HF hub, read where "
                "the run starts"
            )
    sets = assign_gpus(recipe)
    needed = gpus_needed(sets)
    if needed:
        verified.append(f"GPUs do not overlap ({describe_gpus(sets)})")
        declared = list(recipe.nodes.values())
        here = node_gpus() if nodes is None else []
        if len(declared) == 1 and needed <= declared[0].gpus:
            verified.append(f"the node's {declared[0].gpus:g} GPUs ([nodes.*]) hold the {needed}")
        elif here and needed <= len(here):
            verified.append(f"this machine's {len(here)} GPUs hold the {needed}")
        elif not declared:
            unverified.append(
                f"that the node has the {needed} GPUs the roles take"
                f"{f' (this machine has {len(here)})' if here else ''}; declare it "
                "([nodes.<name>] gpus = N), and asyncrl up checks it where it starts"
            )
    if nodes is None and not gpu_visible():
        unverified += [
            f"{line}: asyncrl up refuses it here; it runs where there is a GPU"
            for line in machine_problems(recipe, [], False)
            if "has no GPU" in line
        ]
    return verified, unverified


def enforce_recipe(recipe: Recipe) -> list[str]:
    """Raises :class:`RecipeError` listing :func:`recipe_problems`' and
    :func:`data_problems`' errors; returns the warnings for the caller to print.
    ``asyncrl check`` and ``asyncrl up`` both call it before anything starts."""
    errors, warnings = recipe_problems(recipe)
    errors += data_problems(recipe)
    if errors:
        raise RecipeError("recipe cannot run:\n" + "\n".join(f"  {e}" for e in errors))
    return warnings

"""``mobizo agent generate`` and ``mobizo agent eval``: the device uses its personal adapters itself.

Both read the agent config (server and device token), fetch what the work folder's cache lacks (the inference
program, the model's weights ``.ptd`` — the one training uses —, the tokenizer, the adapter's B; all by sha256),
load the base once and set the adapter's B. ``generate`` streams tokens as ``mobizo generate`` does; ``eval``
scores a task's local data through the program's logits exactly as ``mobizo eval`` scores it in PyTorch.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from shared.errors import ExitCode, UsageError


def _check(args: argparse.Namespace) -> None:
    if args.adapter_id is None and not args.model:
        raise UsageError("adapter_id", "give one of your adapters' ids, or --model NAME for the base model")
    if args.adapter_id is not None and args.adapter_id < 1:
        raise UsageError("adapter_id", f"must be a positive id, got {args.adapter_id}")
    if args.max_context < 2:
        raise UsageError("max_context", f"must be at least 2, got {args.max_context}")
    if args.action == "eval":
        from shared.commands.eval import check_numbers

        if not Path(args.data).is_file():
            raise UsageError("data", f"no such file: {args.data}")
        check_numbers(args)
    else:
        from shared.commands.generate import sampling_from

        sampling_from(args)  # checks --temperature and --top-p before anything is fetched
        if args.backend != "executorch" and args.temperature != 0:
            greedy = f"the native runner decodes greedily: use --temperature 0 with {args.backend}"
            raise UsageError("temperature", greedy)


def run_local(args: argparse.Namespace) -> ExitCode:
    _check(args)
    from device_agent import api
    from device_agent.config import config_path, load_config
    from device_agent.daemon import default_work_dir
    from device_agent.events import Reporter
    from device_agent.job import retry_policy
    from device_agent.local_inference import LocalModels
    from shared.retry import Backoff
    from shared.tokenizer_file import load_tokenizer_file

    cfg = load_config(config_path(args.config))
    work_dir = args.work_dir or default_work_dir(cfg.device_id)
    policy = retry_policy(threading.Event(), Backoff(cap=30.0), Reporter(stream=sys.stderr))
    with api.client(cfg.server_url, cfg.token) as http:
        models = LocalModels(api.DeviceAPI(http), work_dir / "cache", policy, args.max_context)
        fetched = models.adapter(args.adapter_id) if args.adapter_id is not None else models.base(args.model)
        if args.action == "generate":
            return _generate(args, models, fetched, work_dir)
        return _evaluate(args, models.session(fetched), load_tokenizer_file(fetched.tokenizer), fetched.adapter)


def _generate(args: argparse.Namespace, models, fetched, work_dir: Path) -> ExitCode:
    from shared.commands.generate import sampling_from, stream
    from shared.data import prompt_token_ids
    from shared.generation import generate
    from shared.tokenizer_file import load_tokenizer_file

    tokenizer = load_tokenizer_file(fetched.tokenizer)
    ids = prompt_token_ids(tokenizer, args.prompt)
    stop = frozenset(fetched.manifest.stop_token_ids)
    if args.backend != "executorch":  # the native runner's generate mode, on the phone (adb) or here (native)
        from device_agent.backends.make import make_generator
        from device_agent.runner_path import runner_default

        runner = args.runner or runner_default(args.backend)
        device = make_generator(args.backend, runner, args.serial, work_dir)
        steps = device.generate(fetched, ids, min(args.max_new_tokens, args.max_context - len(ids)), stop)
    else:
        session = models.session(fetched)
        steps = generate(session, ids, args.max_new_tokens, sampling_from(args), stop, session.max_context)
    stream(steps, tokenizer, len(ids), args.json)
    return ExitCode.OK


def _card(adapter) -> dict | None:
    """An adapter's prompt contract as a card (``shared.adapter.make_card``'s ``task`` and ``prompt``)."""
    if adapter is None or adapter.prompt is None:
        return None
    prompt = adapter.prompt.model_dump()
    return {"task": prompt["task"], "prompt": prompt | {"chat_template": prompt["chat"] is not None}}


def _evaluate(args: argparse.Namespace, session, tokenizer, adapter) -> ExitCode:
    """Score the task's local data through the program, read through the adapter's trained prompt unless told
    otherwise (``shared.prompts.trained_prompt``)."""
    from device_agent.local_inference import ProgramAsModel
    from shared.commands.eval import summary
    from shared.data import load_examples
    from shared.evaluate import evaluate
    from shared.prompts import trained_line, trained_prompt
    from shared.tasks import get_task, parse_verbalizer, with_chat

    template, verbalizer = args.template, parse_verbalizer(args.verbalizer)
    trained = trained_prompt(args.task, template, verbalizer, False, args.prompt, _card(adapter))
    frame = prior = None
    if trained is not None:
        print(f"{args.task}: {trained_line(trained)} (--prompt builtin: the task's own)", file=sys.stderr)
        template, verbalizer, frame = trained["template"], trained["verbalizer"], trained["chat"]
        prior = tuple(trained["prior"]) or None
    task = with_chat(get_task(args.task, template, verbalizer), frame)
    rendered = load_examples(task, args.data, args.limit)
    context = session.max_context
    max_len = min(args.seq_len or context, context)
    metrics = evaluate(ProgramAsModel(session), tokenizer, task, rendered, args.batch_size, max_len, False, None, prior)
    print(json.dumps(metrics) if args.json else summary(task.name, metrics))
    return ExitCode.OK

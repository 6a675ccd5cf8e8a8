"""A fine-tuning jobs service: agents upload pairs (or raw run logs), start DPO jobs over HTTP, poll them and chat
with the result, through the official `openai` SDK (only `base_url` changed) or nip's language-model-server client.

    make serve [ARGS="--port 8000 --max_jobs 1 --train_args='--max_length 256'"]
    python serve.py [--host 127.0.0.1] [--port 8000] [--output_dir artifacts] [--max_jobs 1] [--train_args="..."]
    python serve.py --runner slurm [--slurm_args="--partition gpu --time 4:00:00"] --max_jobs 8   # jobs go to SLURM
    python serve.py --engine vllm      # answers through `vllm serve` on the GPU, adapters loaded as jobs succeed
    DPO_KIT_API_KEY=secret python serve.py --host 0.0.0.0     # any host but loopback needs an API key (Bearer)
    docker run -p 8000:8000 -e DPO_KIT_API_KEY=secret -v $PWD/artifacts:/artifacts dpo-kit serve --host 0.0.0.0 \
        --output_dir /artifacts

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", method={"type": "dpo"},
                                         training_file=client.files.create(file=open("pairs.jsonl", "rb"),
                                                                           purpose="fine-tune").id)

Endpoints (docs/service.md has the table; the running service describes them at /openapi.json and /docs):
/v1/files, /v1/fine_tuning/jobs (create, list, get, cancel, pause, resume, events, checkpoints), /v1/models,
/v1/chat/completions, /v1/completions, /v1/responses, /v1/fine_tuning/alpha/graders/run and /validate
(api_openai.py, api_chat.py, api_responses.py, api_graders.py: graders' judges are this service's own chat unless --judge_base_url names another); nip's
/version, /training/jobs and /vllm/* (api_nip.py); DELETE /v1/models/{model} and vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter (api_adapters.py); service.py holds what they share. Answers go to a serving engine where
there is one (engine.py: vLLM on a GPU, or --engine_url), else to the service's own sampler. This file is the
command line and `create_app`, which assembles them.

Each job is a separate `train_dpo.py` process (or scaleout.py / launcher.py with --gpus / --runner docker; with
--runner slurm, a SLURM job: slurm.py and docs/slurm.md), one at a time by default, so a crashed training never takes the service down and status requests never wait on it.
Files, jobs and events live in SQLite (WAL) at <output_dir>/serve/serve.db; uploads in <output_dir>/serve/files/<id>
(never under the client's filename); each job trains the run <output_dir>/<job id>/ with the kit's run directory,
lock, resume and tarball. Stop the service (SIGTERM, or kill -9: the trainer gets SIGTERM from the kernel) and
start it again: queued jobs stay queued and the running one resumes from its last checkpoint.
"""


import contextlib
import dataclasses
import os
import shutil
import sys

from dpokit.core import kit
from dpokit.train import config
from dpokit.service import slurm
from dpokit.core.kit import UserError, field
from dpokit.service.jobs import Scheduler

ROOT = str(kit.ROOT)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass
class ServeConfig:
    host: str = field("127.0.0.1", "address to bind; anything but loopback needs DPO_KIT_API_KEY (Bearer)")
    port: int = field(8000, "TCP port")
    output_dir: str = field("artifacts", "runs go to <output_dir>/<job id>/; the service's database and uploads "
                            "to <output_dir>/serve/")
    models_dir: str = field("models", "base models a job may name by their directory name (besides the bundled "
                            "model, hub ids and fine-tuned models); a path never comes from a request")
    model_map: str = field("", "OpenAI model names a client's code sends, each to a base the service has, so the "
                           "code runs unchanged: 'gpt-4o-mini*=Qwen2.5-7B-Instruct,gpt-4.1-nano*=SmolLM2-135M-"
                           "Instruct' (a name ending in * matches every name it starts; the first match wins)")
    max_jobs: int = field(1, "jobs training at the same time (each is its own process)")
    max_file_mb: float = field(512.0, "largest upload, in MB (a larger one gets 413)")
    train_args: str = field("", "train_dpo.py flags for every job, before the job's own hyperparameters "
                            "(--train_args='--max_length 256 --probes=', with =); checked at start")
    runner: str = field("local", "how a job trains: local (train_dpo.py, or scaleout.py with --gpus N), docker "
                        "(launcher.py: the kit's image) or slurm (an sbatch script per job: slurm.py)",
                        choices=("local", "docker", "slurm"))
    slurm_args: str = field("", "with --runner slurm: slurm.py's options for every job (--slurm_args='--partition "
                            "gpu --time 4:00:00 --nodes 2 --gpus_per_node 8'); checked at start")
    gpus: str = field("", "GPUs for each job, as make's GPUS= ('' = train_dpo.py's own choice; N or 0,1: "
                      "accelerate through scaleout.py; all)")
    poll_seconds: float = field(0.5, "how often the scheduler looks at validations, processes and metrics")
    shutdown_seconds: float = field(120.0, "on SIGTERM, how long to wait for trainings to save a checkpoint")
    warm_models: int = field(2, "models kept loaded for chat completions (least recently used goes first)")
    nip_version: str = field("1", "the version /version reports to nip's client, which refuses a server whose "
                             "major version differs from its own: '1' matches any nip 1.x.y (nip is 1.0.0 on)")
    limits_graders: bool = field(False, "run users' python graders where the sandbox has only its `limits` mode (no "
                                 "bubblewrap, no namespaces: Landlock and limits alone); off, such a job is refused")
    judge_base_url: str = field("", "graders' judge (score_model, label_model): an OpenAI-compatible /v1 whose chat "
                                "completions grade, for /graders/run and the jobs' training ('' = this service's own "
                                "chat, on its models; key: $DPO_KIT_JUDGE_API_KEY)")
    embeddings_base_url: str = field("", "text_similarity's cosine: an OpenAI-compatible /v1 serving /embeddings ('' = "
                                     "cosine is refused; key: $DPO_KIT_EMBEDDINGS_API_KEY, else the judge's)")
    embeddings_model: str = field("", "the embeddings model cosine asks --embeddings_base_url for")
    vllm_port: int = field(8001, "where /vllm/start runs `vllm serve` when vLLM and a GPU are here and no --engine "
                           "serves the model (0: never; the service's own chat completions serve the model instead)")
    engine: str = field("auto", "what answers chat, completions and responses: vllm (one `vllm serve` of "
                        "--engine_model on this machine's GPU; each fine-tuned model of that base a LoRA adapter "
                        "loaded when its job succeeds), kit (the service's own sampler), or auto (vllm where `vllm` is "
                        "on the PATH and a GPU is here, else kit)", choices=("auto", "kit", "vllm"))
    engine_url: str = field("", "an OpenAI-compatible engine already running, with vLLM's run-time LoRA endpoints "
                            "(http://host:port; it reads the runs' directories), instead of starting one; its key: "
                            "$DPO_KIT_ENGINE_API_KEY")
    engine_model: str = field("", "the base the engine serves, by the service's name for it ('' = the bundled model); "
                              "other bases are answered by the service's own sampler")
    engine_port: int = field(8002, "where the `vllm serve` the service starts listens, on 127.0.0.1")
    engine_gpu_memory: float = field(0.5, "share of the GPU's memory vLLM takes (--gpu-memory-utilization); the rest "
                                     "is left to the jobs' training")
    max_loras: int = field(4, "adapters vLLM runs in one batch (--max-loras); more stay loaded and take turns")
    max_lora_rank: int = field(64, "the largest adapter rank vLLM takes (--max-lora-rank: 1, 8, 16, 32, 64, 128, 256, "
                               "320 or 512); a job trained with a larger --lora_r is answered by the service's sampler")
    engine_args: str = field("", "more `vllm serve` flags (--engine_args='--max-model-len 4096 --enforce-eager')")
    runtime_lora: bool = field(False, "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter as vLLM does "
                               "with VLLM_ALLOW_RUNTIME_LORA_UPDATING (a finished run's directory served under the "
                               "name the request gives), so this service can be another's --engine_url; off: 404")

    def problems(self) -> list[str]:
        p = []
        if not 0 < self.port < 65536 or not 0 <= self.vllm_port < 65536:
            p.append(f"--port and --vllm_port must be in 1..65535 (got {self.port}, {self.vllm_port})")
        if self.max_jobs < 1 or self.warm_models < 1:
            p.append("--max_jobs and --warm_models must be at least 1")
        if self.max_file_mb <= 0 or self.poll_seconds <= 0:
            p.append("--max_file_mb and --poll_seconds must be positive")
        if self.host not in LOOPBACK and not os.environ.get("DPO_KIT_API_KEY"):
            p.append(f"--host {self.host} reaches beyond this machine: set DPO_KIT_API_KEY (clients send it as "
                     "'Authorization: Bearer <key>', the openai SDK's api_key)")
        from dpokit.service.engine import config_problems  # inside: fastapi is imported only when the app is made, so --help stays instant
        from dpokit.service.service import parse_model_map  # inside: fastapi is imported only when the app is made, so --help stays instant

        p += config_problems(self)

        try:
            parse_model_map(self.model_map)
        except ValueError as e:
            p.append(f"--model_map: {e}")
        if flag_problem := train_args_problem(self.train_args):
            p.append(f"--train_args: {flag_problem}")
        if self.slurm_args and self.runner != "slurm":
            p.append("--slurm_args is for --runner slurm")
        elif self.runner == "slurm" and (flag_problem := slurm_args_problem(self.slurm_args)):
            p.append(f"--slurm_args: {flag_problem}")
        if self.runner == "slurm" and not shutil.which("sbatch"):
            p.append("--runner slurm: sbatch is not on the PATH (run the service on a machine of the cluster, such "
                     "as a login node)")
        if bool(self.embeddings_base_url) != bool(self.embeddings_model):
            p.append("--embeddings_base_url and --embeddings_model go together (cosine asks that endpoint for that "
                     "model's embeddings)")
        if os.environ.get("DPO_KIT_JUDGE_API_KEY") and not self.judge_base_url:
            p.append("DPO_KIT_JUDGE_API_KEY is set but --judge_base_url is not (the judge is this service's own chat, "
                     "reached with DPO_KIT_API_KEY): give the judge's URL, or unset the key")
        for name in ("judge_base_url", "embeddings_base_url"):
            if getattr(self, name) and not getattr(self, name).startswith(("http://", "https://")):
                p.append(f"--{name} is an http(s) URL of an OpenAI-compatible /v1 (got {getattr(self, name)!r})")
        if self.runner == "slurm" and self.gpus:
            p.append("--runner slurm: give GPUs per node as --slurm_args='--gpus_per_node N' (make: GPUS=N)")
        return p


def flags_problem(cfg_cls, flags: str, given: tuple = ()) -> str | None:
    """Why a script would refuse these flags (an unknown flag, a bad value, its config's problems()), or None.
    given: flags the script always gets besides (train_dpo.py's --data)."""
    import io
    import shlex

    try:
        argv = shlex.split(flags)
    except ValueError as e:
        return str(e)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            kit.parse_config(cfg_cls, [*given, *argv], "")
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "not accepted"
    except UserError as e:
        return str(e).replace("bad options:\n  - ", "").replace("\n  - ", "; ")
    return None


def train_args_problem(train_args: str) -> str | None:
    """Why train_dpo.py would refuse these flags, or None."""
    return flags_problem(config.TrainConfig, train_args, ("--data", "x.jsonl"))


def slurm_args_problem(slurm_args: str) -> str | None:
    """Why slurm.py would refuse these options, or None."""
    return flags_problem(slurm.SlurmConfig, slurm_args)


def create_app(cfg):
    """The FastAPI application: the shared state, the scheduler thread (started and stopped with the app),
    errors in OpenAI's shape, the API key, the upload limit, and the three APIs' routers."""
    import asyncio
    import hmac
    import traceback

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from dpokit.service import api_adapters  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import api_chat  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import engine  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import api_exports  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import api_graders  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import api_nip  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import api_openai  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service import api_responses  # inside: fastapi is imported only when the app is made, so --help stays instant
    from dpokit.service.service import VERSION, ApiError, Service, validation_message  # inside: fastapi is imported only when the app is made, so --help stays instant

    svc = Service(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if cfg.runner == "slurm":
            scheduler = slurm.SlurmScheduler(cfg, svc.store)
        else:
            scheduler = Scheduler(cfg, svc.store)
        scheduler.start()
        if svc.engine is not None:
            svc.engine.begin()
        print(f"[serve] http://{cfg.host}:{cfg.port}/v1 (jobs in {svc.store.path}; runs in {svc.out}/<job id>/; "
              f"API: /docs)", flush=True)
        yield
        if svc.nip_serving is not None:  # a vLLM server the service started goes with it
            await asyncio.get_running_loop().run_in_executor(None, svc.nip_serving.stop, 5.0)
        if svc.engine is not None:  # so does the engine it started
            await asyncio.get_running_loop().run_in_executor(None, svc.engine.end)
        scheduler.stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stopped.wait)

    app = FastAPI(title="dpo-kit fine-tuning jobs", version=VERSION, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI's files, fine-tuning jobs, models and chat completions; nip's "
                              "language-model-server API. Errors: {error: {message, type, param, code}}.")

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, e: RequestValidationError):
        message, param = validation_message(e.errors())
        return JSONResponse(ApiError(400, message, param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        message = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        traceback.print_exc()
        return JSONResponse(ApiError(500, "internal error; the service's log has the details", kind="server_error")
                            .body(), status_code=500)

    limit_bytes = int(cfg.max_file_mb * 1e6)

    @app.middleware("http")
    async def upload_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        if request.url.path == "/v1/files" and length and length.isdigit() and int(length) > limit_bytes + 65536:
            return JSONResponse(ApiError(413, f"the file is over the service's limit of {cfg.max_file_mb:g} MB "
                                         "(--max_file_mb)", "file", "file_too_large").body(), status_code=413)
        return await call_next(request)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):  # added last: runs first, for every path (/docs too)
        if svc.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {svc.api_key}".encode()):
                return JSONResponse(ApiError(401, "missing or wrong API key (Authorization: Bearer <DPO_KIT_API_KEY>)",
                                             code="invalid_api_key").body(), status_code=401)
        return await call_next(request)

    svc.chat = api_chat.Chat(cfg)  # the models loaded for chat completions, and the one model nip serves
    svc.nip_serving = api_nip.Serving(svc)
    svc.engine = engine.make(cfg, svc)  # vLLM or --engine_url where answers go; None: the service's own sampler
    app.state.service = svc  # what a route's `svc: Svc` parameter is given (service.current)
    for api in (api_openai, api_exports, api_graders, api_adapters, api_chat, api_responses, api_nip):  # a router each
        app.include_router(api.router)
    return app


def main(argv=None) -> int:
    cfg = kit.parse_config(ServeConfig, argv, __doc__)
    import uvicorn

    # Jobs run train_dpo.py from the kit's directory (the bundled model's path is relative to it): so does this.
    cfg = dataclasses.replace(cfg, output_dir=os.path.abspath(cfg.output_dir), models_dir=os.path.abspath(
        cfg.models_dir) if os.path.isabs(cfg.models_dir) or os.path.isdir(cfg.models_dir) else cfg.models_dir)
    os.chdir(ROOT)

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))

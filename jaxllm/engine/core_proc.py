"""The engine core in its own process: load, compile, then loop — take requests and
aborts from the frontend, step while there is work, send outputs after every step
(and a heartbeat with the scheduler stats every second while idle, and a bare one
four times a second while a step compiles a shape at first use).

The process exits when the frontend says shutdown or goes away (end of pipe), so it
never outlives the server. It ignores SIGINT: a Ctrl-C reaches the whole process group,
and shutting down is the frontend's call.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection

from jaxllm.engine import serialization as wire
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.core import EngineCore, eos_token_id
from jaxllm.engine.protocol import (
    CORE_UTILITIES,
    EngineCoreReady,
    EngineCoreRejection,
    LoRAUpdate,
    LoRAUpdateResult,
    UtilityCall,
    UtilityResult,
)
from jaxllm.logs import configure_logging, log_level
from jaxllm.messages import EngineCoreOutputs
from jaxllm.multimodal.image_processor import ImageProcessorConfig

logger = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 1.0


def run_engine_core(config: EngineConfig, conn: Connection) -> None:
    """Entry point of the engine core process. Bad input at start-up (a model that is
    not there, a checkpoint it cannot hold, an option the model refuses: FileNotFoundError,
    ValueError) is sent as its message alone, its traceback logged at debug level; any
    other failure with its traceback."""
    if threading.current_thread() is threading.main_thread():  # not in a Ray actor's thread (ray_replicas)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level(), tag="engine core")
    try:
        core = EngineCore(config, progress=True)
    except (FileNotFoundError, ValueError) as e:
        logger.debug("engine core start-up failed:\n%s", traceback.format_exc())
        _send_fatal(conn, f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    except Exception:
        _fail(conn)
        raise
    try:
        model = core.model
        compiled = (f"compiled in {core.warmup_seconds:.1f} s" if config.warm_up
                    else "each step shape compiled at its first step (warm_up off)")
        print(f"model {model.path.name} loaded in {model.load_seconds:.1f} s; {core.describe()}; {compiled}", flush=True)
        tokenizer_dir = tempfile.mkdtemp(prefix="jaxllm-tokenizer-")
        model.tokenizer.save_pretrained(tokenizer_dir)
        ready = EngineCoreReady(
            max_model_len=core.max_model_len,
            vocab_size=model.config.vocab_size,
            eos_token_id=eos_token_id(model.tokenizer, model.config),
            tokenizer_dir=tokenizer_dir,
            num_blocks=core.cache.num_blocks,
            block_size=core.cache.block_size,
            load_seconds=model.load_seconds,
            warmup_seconds=core.warmup_seconds,
            runner="generate" if core.pooler is None else "pooling",
            pooler=core.pooler,
            hidden_size=model.config.hidden_size,
            vision=model.config.vision,
            image_processor=None if model.config.vision is None else ImageProcessorConfig.from_folder(model.path),
            images_per_prompt=config.images_per_prompt,
        )
        conn.send_bytes(wire.encode(wire.READY, ready))
        loop = EngineCoreLoop(core, conn)
        core.watch_compiles(loop.compiling)
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the frontend is gone: nothing left to serve
    except Exception:
        _fail(conn)
        raise


def _fail(conn: Connection) -> None:
    """Log the exception being handled and send its traceback to the frontend."""
    message = traceback.format_exc()
    logger.error("engine core failed:\n%s", message)
    _send_fatal(conn, message)


def _send_fatal(conn: Connection, message: str) -> None:
    try:
        conn.send_bytes(wire.encode(wire.FATAL, message))
    except OSError:
        pass  # the frontend is gone


class EngineCoreLoop:
    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.last_sent = time.monotonic()
        self._sending = threading.Lock()  # the loop's and `compiling`'s heartbeat thread's messages

    def run(self) -> None:
        while True:
            timeout = 0.0 if self.core.has_work() else HEARTBEAT_SECONDS
            while self.conn.poll(timeout):
                if not self._handle(*wire.decode(self.conn.recv_bytes())):
                    return
                timeout = 0.0
            if self.core.has_work():
                self._send(self.core.step())
            elif time.monotonic() - self.last_sent >= HEARTBEAT_SECONDS:
                self._send(EngineCoreOutputs([], self.core.scheduler.make_stats()))

    def _handle(self, kind: str, payload) -> bool:
        """Apply one frontend message; False means shut down."""
        if kind == wire.ADD:
            try:
                self.core.add_requests(payload)
            except ValueError as e:
                for request in payload:
                    self._send_bytes(wire.encode(wire.REJECTED, EngineCoreRejection(request.request_id, str(e))))
        elif kind == wire.ABORT:
            self.core.abort_requests(payload)
        elif kind == wire.LORA:
            self._send_bytes(wire.encode(wire.LORA_RESULT, self._update_lora(payload)))
        elif kind == wire.UTILITY:
            self._send_bytes(wire.encode(wire.UTILITY_RESULT, self._utility(payload)))
        elif kind == wire.SHUTDOWN:
            return False
        return True

    def _update_lora(self, update: LoRAUpdate) -> LoRAUpdateResult:
        try:
            if update.add is not None:
                self.core.add_lora(update.add)
            if update.remove is not None and not self.core.remove_lora(update.remove):
                return LoRAUpdateResult(update.op_id, f"no LoRA adapter with id {update.remove} is loaded")
        except ValueError as e:
            return LoRAUpdateResult(update.op_id, str(e))
        return LoRAUpdateResult(update.op_id)

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in CORE_UTILITIES:
            return UtilityResult(call.op_id, error=f"unknown engine core utility {call.method!r}")
        try:
            value = getattr(self.core, call.method)(*call.args)
        except RuntimeError as e:  # requests in flight
            return UtilityResult(call.op_id, error=str(e), busy=True)
        except (ValueError, OSError) as e:
            return UtilityResult(call.op_id, error=str(e))
        if isinstance(value, EngineCoreOutputs):  # pause's: the requests it ended, before its answer
            self._send(value)
            value = None
        return UtilityResult(call.op_id, value=value)

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self._send_bytes(wire.encode(wire.OUTPUTS, outputs))

    def _send_bytes(self, message: bytes) -> None:
        with self._sending:
            self.conn.send_bytes(message)
            self.last_sent = time.monotonic()

    @contextlib.contextmanager
    def compiling(self):
        """Around a compile at first use (EngineCore.watch_compiles): a bare heartbeat as
        it starts and every quarter of HEARTBEAT_SECONDS until it ends, from a thread of
        its own, so that the frontend, which takes a busy core's silence for
        `--engine-hang-timeout` (over HEARTBEAT_SECONDS) as a hang, does not take a long
        compile, or a step's few compiles with its other work between them, for one."""
        done = threading.Event()

        def beat() -> None:
            while True:
                try:
                    self._send(EngineCoreOutputs([]))
                except OSError:
                    return  # the frontend is gone: the loop finds out too
                if done.wait(HEARTBEAT_SECONDS / 4):
                    return

        thread = threading.Thread(target=beat, name="compile heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

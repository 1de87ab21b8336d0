#!/usr/bin/env python3
"""Issue 13's fault sweep (tests/fault_sweep.sh runs it).

Every case is a shell command run by bash in a fresh directory (its cwd) with TMPDIR set to a
private, empty folder and DC_SWEEP_CASE set to the case's name, so that a surviving rank can be
found by its environment. Fixtures (a trace, plans, token files, a checkpoint, an export) are made
once and reached as $F; $DC is the folder of the binaries.

A case expects one of:
  usage   exit 2 (the command line does not parse), the flag named
  value   exit 2 or 1 (a value out of its range: CLI11's check or the model's own), named
  error   exit 1, one line on stderr naming the file or flag (`words`)
  warn    exit 0 and `words` in stdout + stderr (a counted warning, the rest usable)
  ok      exit 0 (a fault the command must take in its stride), optional check
  either  exit 0, or exit 1 with one line holding `words`
  signal  the launcher is sent a signal once `ready` shows in its output; it must exit 128 + sig

Classification, worst first:
  hung            over the case's time limit (killed)
  crashed         killed by a signal it was not sent, an abort or sanitizer text, or a failure
                  with nothing on stderr
  silently wrong  exit 0 where an error was due, or a check of the result failed
  partial         files left in the case's folder or TMPDIR, new /tmp/dc-rendezvous-*, or a
                  process of the case still alive 3 s after the command ended
  unclear         a failure whose message lacks the file or flag, runs over one line, or exits
                  with the other code of the convention (2 usage, 1 everything else)
  clear           everything else
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HANG_S = 60
CLASSES = ["clear", "unclear", "partial", "silently wrong", "crashed", "hung"]
CRASH_TEXT = re.compile(
    r"terminate called|Aborted|Segmentation fault|core dumped|Sanitizer|runtime error:|"
    r"std::bad_alloc|what\(\):"
)
HINT = re.compile(
    r"re-plan|re-record|use |give |set |pass |choose|remove|enable|write it|must|should|"
    r"needs|try|at least|at most|one of|is not|expected|run |drop|check|is a directory|"
    r"does not exist|no such|cannot|only|;"
)


class Case:
    def __init__(self, name, cmd, expect, words=(), keep=(), check=None, timeout=HANG_S,
                 ready=None, sig=None, max_wall=None, setup=None, nobody=False, after=None):
        self.name, self.cmd, self.expect = name, cmd, expect
        self.words, self.keep, self.check = list(words), list(keep), check
        self.timeout, self.ready, self.sig = timeout, ready, sig
        self.max_wall, self.setup, self.nobody = max_wall, setup, nobody
        # Run after the command (and its signal), in the same folder and TMPDIR, before the
        # leftovers are counted: what a user's next run cleans up is not left behind.
        self.after = after


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(cmd, cwd, env=None, timeout=300):
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"fixture failed: {cmd}\n{r.stderr}")
    return r.stdout


def make_fixtures(F, DC):
    os.makedirs(F, exist_ok=True)
    c = f"{DC}/dc-collect --backend cpu --quiet --steps 1 --warmup 0"
    p = f"{DC}/dc-plan --no-cache --quiet"
    steps = [
        f"{c} --model tiny -o good.db",
        f"{c} --model tiny --nproc 2 -o two.db",
        f"{p} good.db -o good.dcplan",
        f"{p} two.db -o two.dcplan",
        "python3 -c 'import struct,random; r=random.Random(1); "
        "open(\"tokens.bin\",\"wb\").write(struct.pack(\"<4096H\", *[r.randrange(256) for _ in range(4096)]))'",
        "cp tokens.bin tokens-orig.bin",
        f"{p} --synthetic --model tiny --vocab 256 --data {F}/tokens.bin --world 1 --hardware cpu -o data.dcplan",
        f"{p} --synthetic --model tiny --vocab 256 --world 1 --hardware cpu -o v256.dcplan",
        f"{p} --synthetic --model tiny --hidden 128 --world 1 --hardware cpu -o other.dcplan",
        f"{DC}/dc-run --backend cpu --quiet good.dcplan --steps 1 --save ckpt --export model",
        "mkdir -p adir emptydir",
        ": > empty.db; : > empty.dcplan; : > empty.txt; : > empty.csv",
        "printf 'hello, this is not a database\\n' > text.db",
        "head -c $(( $(stat -c %s good.db) / 3 )) good.db > truncated.db",
        "head -c $(( $(stat -c %s good.dcplan) - 10 )) good.dcplan > truncated.dcplan",
        "cp good.dcplan appended.dcplan; printf 'extra bytes' >> appended.dcplan",
        "python3 -c 'b=bytearray(open(\"good.dcplan\",\"rb\").read()); b[len(b)//2]^=0x11; "
        "open(\"corrupt.dcplan\",\"wb\").write(b)'",
        "python3 -c 'b=bytearray(open(\"good.dcplan\",\"rb\").read()); b[8]=42; open(\"newer.dcplan\",\"wb\").write(b)'",
        "python3 -c 'b=bytearray(open(\"good.dcplan\",\"rb\").read()); b[8]=1; open(\"older.dcplan\",\"wb\").write(b)'",
        "python3 -c 'b=bytearray(open(\"good.dcplan\",\"rb\").read()); b[0:8]=b\"NOTAPLAN\"; open(\"magic.dcplan\",\"wb\").write(b)'",
        "printf '\\x01\\x02\\x03' > odd.bin",
        "python3 -c 'import struct; open(\"big-ids.bin\",\"wb\").write(struct.pack(\"<4096H\", *([60000]*4096)))'",
        "python3 -c 'import struct; open(\"short.bin\",\"wb\").write(struct.pack(\"<8H\", *range(8)))'",
        "printf 'name,model,world,colour\\n' > columns.csv",
        "printf 'name,model,world,gas,micro_batch,policy,measured_seconds\\n' > header.csv",
        "cp header.csv policy.csv; echo 'a,tiny,2,1,1,fastest,0.1' >> policy.csv",
        "cp header.csv nan.csv; echo 'a,tiny,2,1,1,dc,nan' >> nan.csv",
        "cp header.csv negative.csv; echo 'a,tiny,2,1,1,dc,-0.5' >> negative.csv",
        "cp header.csv preset.csv; echo 'a,gpt5,2,1,1,dc,0.5' >> preset.csv",
        "cp header.csv world0.csv; echo 'a,tiny,0,1,1,dc,0.5' >> world0.csv",
        "cp header.csv words.csv; echo 'a,tiny,two,1,1,dc,0.5' >> words.csv",
        "cp header.csv short.csv; echo 'a,tiny,2' >> short.csv",
        "cp header.csv good.csv; echo 'a,tiny,2,1,1,dc,0.5' >> good.csv",
        "printf '# Collective test starting: all_gather_perf\\n#  Rank  0 Group  0 Pid  1 on  a device  0 [0x18] X\\n"
        "#       size         count      type   redop    root     time   algbw   busbw\\n' > ag-norows.txt",
        "cp ag-norows.txt ag-nan.txt; echo '  1024  256  float  none  -1  nan  0.1  0.1' >> ag-nan.txt",
        "cp ag-norows.txt ag-neg.txt; echo '  1024  256  float  none  -1  -5.0  0.1  0.1' >> ag-neg.txt",
        "printf 'random words\\nnot nccl-tests\\n' > ag-text.txt",
        f"{DC}/dc-plan --hardware cpu --print-hardware > hw.json",
        "python3 -c 'import json; h=json.load(open(\"hw.json\")); "
        "h[\"profiles\"][0][\"constants\"][\"peak_fp32_flops_per_s\"][\"value\"]=-1; "
        "json.dump(h, open(\"hw-neg.json\",\"w\"))'",
        "printf '{\"name\": ' > hw-bad.json",
        "printf '{\"traceEvents\": [{\"ph\": \"X\", \"cat\": \"kernel\", \"ts\": 1e300, \"dur\": 1}]}' > k-1e300.json",
        "printf '{\"traceEvents\": [{\"ph\": \"X\", \"cat\": \"kernel\", \"ts\": 1e400, \"dur\": 1}]}' > k-1e400.json",
        "printf '{\"traceEvents\": [{\"ph\": \"X\", \"cat\": \"kernel\", \"ts\": 10, \"dur\": -5}]}' > k-negdur.json",
        "printf '{\"traceEvents\": []}' > k-empty.json",
        "printf '{\"events\": 3}' > k-noevents.json",
        "printf '[1, 2, 3]' > k-list.json",
        "printf '{\"traceEvents\": [{\"ph\": \"X\", \"cat\": \"kernel\", \"ts\": \"abc\", \"dur\": 1}]}' > k-string.json",
        "printf 'not gzip at all' > k-bad.json.gz",
        "printf '{\"traceEvents\": [{\"ph\": \"X\", \"cat\": \"kernel\", \"ts\": 10, \"dur\": 1e300}]}' > k-hugedur.json",
        "echo '{' > model-badconfig.json",
    ]
    for s in steps:
        sh(s, F)
    # An export whose config.json does not parse, another whose weights file is cut short.
    shutil.copytree(f"{F}/model", f"{F}/model-badconfig")
    shutil.copy(f"{F}/model-badconfig.json", f"{F}/model-badconfig/config.json")
    shutil.copytree(f"{F}/model", f"{F}/model-cut")
    st = f"{F}/model-cut/model.safetensors"
    with open(st, "rb") as f:
        data = f.read()
    with open(st, "wb") as f:
        f.write(data[: len(data) // 2])
    os.chmod(F, 0o755)


# Corrupt trace rows, made with the sqlite3 tool on a copy of a freshly collected trace.
def loosen(table):
    return (f"CREATE TABLE loose AS SELECT * FROM {table}; DROP TABLE {table}; "
            f"ALTER TABLE loose RENAME TO {table};")


FIRST_K = "WHERE rowid = (SELECT MIN(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)"
CORRUPT = [
    # name, sql, kind: 'warn' (counted, rest usable) or 'error', words
    ("end-before-start", f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1 {FIRST_K}",
     "warn", ["end before start"]),
    ("null-start", loosen("CUPTI_ACTIVITY_KIND_KERNEL") +
     "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL WHERE rowid = 1", "warn", ["start"]),
    ("null-end", loosen("CUPTI_ACTIVITY_KIND_KERNEL") +
     "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = NULL WHERE rowid = 1", "warn", ["end"]),
    ("null-globalpid", loosen("CUPTI_ACTIVITY_KIND_KERNEL") +
     "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET globalPid = NULL WHERE rowid = 1", "warn",
     ["globalPid"]),
    ("null-stream", loosen("CUPTI_ACTIVITY_KIND_KERNEL") +
     "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET streamId = NULL WHERE rowid = 1", "warn",
     ["streamId"]),
    ("text-start", loosen("CUPTI_ACTIVITY_KIND_KERNEL") +
     "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'soon' WHERE rowid = 1", "warn", ["start"]),
    ("null-bytes", loosen("CUDA_GPU_MEMORY_USAGE_EVENTS") +
     "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = NULL WHERE rowid = 1", "warn", ["bytes"]),
    ("negative-bytes",
     "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = -9223372036854775807 WHERE rowid = 1",
     "warn", ["bytes"]),
    ("huge-bytes",
     "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = 9223372036854775807 WHERE rowid <= 3",
     "warn", ["bytes"]),
    ("huge-end", f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = 9223372036854775807 {FIRST_K}",
     "warn", ["end"]),
    ("negative-start",
     f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = -9223372036854775807 {FIRST_K}", "warn",
     ["start"]),
    ("no-kernel-rows", "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL", "error", ["kernel"]),
    ("no-kernel-table", "DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL", "error",
     ["CUPTI_ACTIVITY_KIND_KERNEL"]),
    ("no-step-rows", "DELETE FROM TC_STEP", "error", ["TC_STEP"]),
    ("duplicate-rank", "UPDATE TC_RANK SET rank = 0", "error", ["rank 0"]),
    ("no-stringids", "DROP TABLE StringIds", "error", ["StringIds"]),
    ("missing-string", "DELETE FROM StringIds WHERE id = (SELECT shortName FROM "
     "CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1)", "warn", ["StringIds"]),
    ("no-blob", "DELETE FROM TC_BLOB", "error", ["TC_BLOB"]),
    ("garbage-blob", "UPDATE TC_BLOB SET data = X'00010203'", "error", ["TC_BLOB"]),
    ("no-rank-rows", "DELETE FROM TC_RANK", "error", ["ranks"]),
]


def cases(F, DC, port):
    C0 = f"{DC}/dc-collect --backend cpu --warmup 0"
    C = C0 + " --steps 1"
    P = f"{DC}/dc-plan --no-cache"
    R0 = f"{DC}/dc-run --backend cpu"
    R = R0 + " --steps 1"
    T = f"{DC}/dc-trace"
    K = f"{DC}/dc-calibrate --base cpu"
    S = f"{P} --synthetic --model tiny --world 2 --hardware cpu"
    out = []

    def add(*a, **k):
        out.append(Case(*a, **k))

    # ---- dc-collect
    add("collect-o-empty", f"{C} --model tiny -o ''", "usage", ["--output"])
    add("collect-o-nodir", f"{C0} --model tiny --steps 30 -o nodir/t.db", "error", ["nodir"],
        max_wall=10)
    add("collect-o-existing-dir", f"mkdir d && {C} --model tiny -o d", "error", ["d"],
        keep=["d"])
    add("collect-o-input-data", f"cp {F}/tokens.bin . && {C} --model tiny --vocab 256 "
        "--data tokens.bin -o tokens.bin", "error", ["tokens.bin"], keep=["tokens.bin"])
    add("plan-o-input-data", f"cp {F}/tokens.bin . && {P} --synthetic --model tiny --vocab 256 "
        "--data tokens.bin --world 1 --hardware cpu -o tokens.bin", "error", ["tokens.bin"],
        keep=["tokens.bin"], check=lambda d, o, e: same_file(d + "/tokens.bin", F + "/tokens.bin"))
    add("run-trace-is-data", f"cp {F}/tokens.bin . && {R} {F}/v256.dcplan --data tokens.bin "
        "--trace tokens.bin", "error", ["tokens.bin"], keep=["tokens.bin"],
        check=lambda d, o, e: same_file(d + "/tokens.bin", F + "/tokens.bin"))
    add("run-trace-is-eval-data", f"cp {F}/tokens.bin . && {R} {F}/v256.dcplan --eval-data "
        "tokens.bin --trace tokens.bin", "error", ["tokens.bin"], keep=["tokens.bin"],
        check=lambda d, o, e: same_file(d + "/tokens.bin", F + "/tokens.bin"))
    add("collect-hidden-2e9", f"{C} --model tiny --hidden 2000000000 -o h.db", "error",
        ["--hidden"], max_wall=10)
    add("collect-hidden-32768", f"{C} --model tiny --hidden 32768 -o h.db", "error",
        ["needs"], max_wall=20)
    add("collect-layers-1e6", f"{C} --model tiny --layers 1000000 -o h.db", "error",
        ["--layers"], max_wall=10)
    add("collect-seq-1e8", f"{C} --model tiny --seq 100000000 -o h.db", "error", ["--seq"],
        max_wall=10)
    add("collect-micro-batch-1e9", f"{C} --model tiny --micro-batch 1000000000 -o h.db",
        "error", ["--micro-batch"], max_wall=10)
    add("collect-experts-1e6", f"{C} --model mixtral-tiny --experts 1000000 -o h.db", "error",
        ["--experts"], max_wall=10)
    add("collect-vocab-1", f"{C} --model tiny --vocab 1 -o v.db", "error", ["--vocab"])
    add("collect-vocab-0", f"{C} --model tiny --vocab 0 -o v.db", "error", ["--vocab"])
    add("collect-vocab-neg", f"{C} --model tiny --vocab -5 -o v.db", "error", ["--vocab"])
    add("collect-router-nan", f"{C} --model mixtral-tiny --router-aux-coef nan -o r.db",
        "error", ["--router-aux-coef"])
    add("collect-router-neg", f"{C} --model mixtral-tiny --router-aux-coef -1 -o r.db",
        "error", ["--router-aux-coef"])
    add("collect-steps-0", f"{C0} --model tiny --steps 0 -o s.db", "value", ["--steps"])
    add("collect-steps-neg", f"{C0} --model tiny --steps -1 -o s.db", "value", ["--steps"])
    add("collect-warmup-neg", f"{C} --model tiny --warmup -1 -o s.db", "value", ["--warmup"])
    add("collect-nproc-0", f"{C} --model tiny --nproc 0 -o s.db", "usage", ["--nproc"])
    add("collect-nproc-neg", f"{C} --model tiny --nproc -2 -o s.db", "usage", ["--nproc"])
    add("collect-model-unknown", f"{C} --model nosuch -o s.db", "value", ["nosuch"])
    add("collect-layers-0", f"{C} --model tiny --layers 0 -o s.db", "error", ["--layers"])
    add("collect-heads-7", f"{C} --model tiny --heads 7 -o s.db", "error", ["--heads"])
    add("collect-kv-heads-3", f"{C} --model tiny --kv-heads 3 -o s.db", "error",
        ["--kv-heads"])
    add("collect-seq-0", f"{C} --model tiny --seq 0 -o s.db", "error", ["--seq"])
    add("collect-micro-batch-0", f"{C} --model tiny --micro-batch 0 -o s.db", "error",
        ["--micro-batch"])
    add("collect-gas-0", f"{C} --model tiny --gas 0 -o s.db", "error", ["--gas"])
    add("collect-dtype-f64", f"{C} --model tiny --dtype f64 -o s.db", "value", ["--dtype"])
    add("collect-lr-neg", f"{C} --model tiny --lr -1 -o s.db", "error", ["--lr"])
    add("collect-lr-nan", f"{C} --model tiny --lr nan -o s.db", "error", ["--lr"])
    add("collect-min-lr-neg", f"{C} --model tiny --min-lr -1 -o s.db", "error", ["--min-lr"])
    add("collect-min-lr-over-lr", f"{C} --model tiny --lr 0.001 --min-lr 0.01 -o s.db",
        "error", ["--min-lr"])
    add("collect-warmup-steps-neg", f"{C} --model tiny --warmup-steps -1 -o s.db", "value",
        ["--warmup-steps"])
    add("collect-lr-decay-word", f"{C} --model tiny --lr-decay exponential -o s.db", "value",
        ["--lr-decay"])
    add("collect-clip-neg", f"{C} --model tiny --clip-grad-norm -0.5 -o s.db", "error",
        ["--clip-grad-norm"])
    add("collect-clip-inf", f"{C} --model tiny --clip-grad-norm inf -o s.db", "error",
        ["--clip-grad-norm"])
    add("collect-top-k-over", f"{C} --model mixtral-tiny --top-k 9 -o s.db", "error",
        ["--top-k"])
    add("collect-top-k-0", f"{C} --model mixtral-tiny --top-k 0 -o s.db", "error", ["--top-k"])
    add("collect-data-missing", f"{C} --model tiny -o s.db --data missing.bin", "error",
        ["missing.bin"])
    add("collect-data-empty", f"{C} --model tiny -o s.db --data {F}/empty.txt", "error",
        ["empty.txt"])
    add("collect-data-odd", f"{C} --model tiny -o s.db --data {F}/odd.bin", "error",
        ["odd.bin"])
    add("collect-data-ids-over-vocab", f"{C} --model tiny --vocab 256 -o s.db --data "
        f"{F}/big-ids.bin", "error", ["big-ids.bin"])
    add("collect-data-short", f"{C} --model tiny --vocab 256 -o s.db --data {F}/short.bin",
        "error", ["short.bin"])
    add("collect-data-dir", f"{C} --model tiny -o s.db --data {F}/adir", "error", ["adir"])
    add("collect-device-memory-1k", f"{C} --model tiny --device-memory 1KiB -o s.db", "error",
        ["--device-memory"])
    add("collect-nproc2-device-memory-1k", f"{C} --model tiny --nproc 2 --device-memory 1KiB "
        "-o s.db", "error", ["--device-memory"])
    add("collect-device-memory-word", f"{C} --model tiny --device-memory lots -o s.db", "usage",
        ["--device-memory"])
    add("collect-backend-cuda", f"{DC}/dc-collect --backend cuda --model tiny --steps 1 -o s.db",
        "error", ["cuda"])
    add("collect-backend-word", f"{DC}/dc-collect --backend tpu --model tiny -o s.db", "usage",
        ["--backend"])
    add("collect-timeout-0", f"{C} --model tiny --timeout 0 -o s.db", "usage", ["--timeout"])
    add("collect-timeout-neg", f"{C} --model tiny --timeout -1 -o s.db", "usage",
        ["--timeout"])
    add("collect-threads-1000", f"{C} --model tiny --threads-per-rank 1000 -o s.db", "error",
        ["--threads-per-rank"])
    add("collect-threads-0", f"{C} --model tiny --threads-per-rank 0 -o s.db", "usage",
        ["--threads-per-rank"])
    add("collect-unknown-flag", f"{C} --model tiny --stepz 3 -o s.db", "usage", ["--stepz"])
    add("collect-no-output", f"{C} --model tiny", "usage", ["--output"])
    add("collect-extra-positional", f"{C} --model tiny -o s.db extra", "usage", ["extra"])
    add("collect-attach-no-gpu", f"{DC}/dc-collect --attach -o s.db -- true", "error",
        [("--attach", "'true'")])
    add("collect-world-size-abc", f"WORLD_SIZE=abc RANK=0 {C} --model tiny -o s.db", "error",
        ["WORLD_SIZE"])
    add("collect-rank-abc", f"WORLD_SIZE=2 RANK=abc {C} --model tiny -o s.db", "error",
        ["RANK"])
    add("collect-rank-over", f"WORLD_SIZE=2 RANK=2 {C} --model tiny -o s.db", "error",
        ["RANK"])
    add("collect-world-size-0", f"WORLD_SIZE=0 RANK=0 {C} --model tiny -o s.db", "error",
        ["WORLD_SIZE"])
    add("collect-local-world-size-abc", f"WORLD_SIZE=1 RANK=0 LOCAL_WORLD_SIZE=abc {C} "
        "--model tiny -o s.db", "error", ["LOCAL_WORLD_SIZE"])
    add("collect-local-rank-abc", f"WORLD_SIZE=1 RANK=0 LOCAL_RANK=abc {C} --model tiny -o s.db",
        "error", ["LOCAL_RANK"])
    add("collect-nproc-vs-world-size", f"WORLD_SIZE=2 RANK=0 {C} --model tiny --nproc 4 -o s.db",
        "error", ["--nproc", "WORLD_SIZE"])
    add("collect-slurm-abc", f"SLURM_PROCID=0 SLURM_NTASKS=x {C} --model tiny -o s.db", "error",
        ["SLURM_NTASKS"])
    add("collect-master-port-abc", f"WORLD_SIZE=2 RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=abc "
        f"{C} --model tiny --timeout 5 -o s.db", "error", ["MASTER_PORT"])
    add("collect-master-port-70000", f"WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 "
        f"MASTER_PORT=70000 {C} --model tiny --timeout 5 -o s.db", "error", ["MASTER_PORT"])
    add("collect-rendezvous-file", f"touch afile && {C} --model tiny --nproc 2 --rendezvous afile "
        "-o s.db", "error", ["afile"], keep=["afile"])
    add("collect-rendezvous-reuse", f"{C} --model tiny --nproc 2 --rendezvous rdzv -o a.db && "
        f"{C} --model tiny --nproc 2 --rendezvous rdzv -o b.db", "ok", keep=["rdzv", "a.db", "b.db"])
    add("collect-tmpdir-missing", f"TMPDIR=$PWD/nosuch {C} --model tiny --nproc 2 -o s.db",
        "either", ["nosuch"], keep=["s.db"])
    add("collect-tmpdir-file", f"touch tf && TMPDIR=$PWD/tf {C} --model tiny --nproc 2 -o s.db",
        "either", ["tf"], keep=["s.db", "tf"])
    add("collect-o-unwritable-dir", f"mkdir ro && chmod 555 ro && {C} --model tiny -o ro/t.db",
        "error", ["ro"], keep=["ro"], nobody=True, max_wall=10)
    for sig, code in (("INT", 130), ("TERM", 143), ("HUP", 129)):
        add(f"collect-nproc2-sig{sig}", f"{DC}/dc-collect --backend cpu --model tiny --nproc 2 "
            "--steps 100000 --warmup 0 -o t.db", "signal", keep=["t.db"],
            ready=8, sig=getattr(signal, "SIG" + sig),
            check=lambda d, o, e, c=code: trace_incomplete(d, DC, "t.db"))
    add("collect-nproc2-sigKILL", f"{DC}/dc-collect --backend cpu --model tiny --nproc 2 "
        "--steps 100000 --warmup 0 -o t.db", "signal", keep=["t.db", "t.db.rank0.part",
                                                          "t.db.rank1.part", "t.db.rank0.part-wal",
                                                          "t.db.rank1.part-wal",
                                                          "t.db.rank0.part-shm",
                                                          "t.db.rank1.part-shm"],
        ready=8, sig=signal.SIGKILL,
        after=f"{DC}/dc-run --backend cpu {F}/two.dcplan --nproc 2 --steps 1 --quiet")
    add("collect-1rank-sigINT", f"{DC}/dc-collect --backend cpu --model tiny --steps 100000 "
        "--warmup 0 -o t.db", "signal", keep=["t.db"], ready=6, sig=signal.SIGINT,
        check=lambda d, o, e: trace_incomplete(d, DC, "t.db"))

    # ---- dc-plan
    add("plan-disable-zero3", f"{P} {F}/good.db --disable zero3 -o p.dcplan", "error", ["zero3"])
    add("plan-synthetic-disable-zero3", f"{S} --disable zero3 -o p.dcplan", "error", ["zero3"])
    add("plan-disable-unknown", f"{P} {F}/good.db --disable nosuch -o p.dcplan", "error",
        ["nosuch"])
    add("plan-dump-after-unknown", f"{P} {F}/good.db --dump-after nosuch -o p.dcplan", "error",
        ["nosuch"])
    add("plan-passes-repeat", f"{P} {F}/good.db --passes zero3,prefetch,zero3 -o p.dcplan",
        "error", ["zero3"])
    add("plan-passes-prefetch-only", f"{P} {F}/good.db --passes prefetch -o p.dcplan", "error",
        ["zero3"])
    add("plan-passes-unknown", f"{P} {F}/good.db --passes zero3,nosuch -o p.dcplan", "error",
        ["nosuch"])
    add("plan-passes-empty", f"{P} {F}/good.db --passes '' -o p.dcplan", "usage", ["--passes"])
    # CLI11 drops the empty item between the commas: bucket and prefetch are off, as meant.
    add("plan-disable-empty-item", f"{P} {F}/good.db --disable bucket,,prefetch -o p.dcplan",
        "either", ["--disable"], keep=["p.dcplan"])
    add("plan-trace-with-hidden", f"{P} {F}/good.db --hidden 128 -o p.dcplan", "error",
        ["--hidden"])
    add("plan-trace-with-world", f"{P} {F}/good.db --world 4 -o p.dcplan", "error", ["--world"])
    add("plan-trace-with-hardware", f"{P} {F}/good.db --hardware h100-sxm -o p.dcplan", "either",
        ["--hardware"], keep=["p.dcplan"])
    add("plan-trace-with-gpus-per-node", f"{P} {F}/good.db --gpus-per-node 8 -o p.dcplan",
        "error", ["--gpus-per-node"])
    add("plan-trace-with-data", f"{P} {F}/good.db --data {F}/tokens.bin -o p.dcplan", "either",
        ["--data"], keep=["p.dcplan"])
    add("plan-o-input", f"cp {F}/good.db t.db && {P} t.db -o t.db", "error", ["t.db"],
        keep=["t.db"], check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("plan-o-input-other-spelling", f"cp {F}/good.db t.db && {P} t.db -o ./t.db", "error",
        ["t.db"], keep=["t.db"], check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("plan-o-input-symlink", f"cp {F}/good.db t.db && ln -s t.db l.db && {P} t.db -o l.db",
        "error", ["l.db"], keep=["t.db", "l.db"],
        check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("plan-o-from-plan", f"cp {F}/good.dcplan p.dcplan && {P} {F}/good.db --from-plan "
        "p.dcplan -o p.dcplan", "error", ["p.dcplan"], keep=["p.dcplan"],
        check=lambda d, o, e: same_file(d + "/p.dcplan", F + "/good.dcplan"))
    add("plan-perfetto-input", f"cp {F}/good.db t.db && {P} t.db -o p.dcplan --perfetto t.db",
        "error", ["t.db"], keep=["t.db"],
        check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("plan-perfetto-is-o", f"{P} {F}/good.db -o p.dcplan --perfetto p.dcplan", "error",
        ["p.dcplan"])
    add("plan-o-empty", f"{P} {F}/good.db -o ''", "usage", ["--output"])
    add("plan-o-nodir", f"{P} {F}/good.db -o nodir/p.dcplan", "error", ["nodir"])
    add("plan-o-dir", f"mkdir d && {P} {F}/good.db -o d", "error", ["d"], keep=["d"])
    add("plan-perfetto-nodir", f"{P} {F}/good.db -o p.dcplan --perfetto nodir/x.json", "error",
        ["nodir"])
    add("plan-perfetto-empty", f"{P} {F}/good.db -o p.dcplan --perfetto ''", "usage",
        ["--perfetto"])
    add("plan-budget-10eib", f"{P} {F}/good.db --budget 10EiB -o p.dcplan", "usage",
        ["--budget"])
    add("plan-budget-1k", f"{P} {F}/good.db --budget 1KiB -o p.dcplan", "error", ["budget"])
    add("plan-budget-neg", f"{P} {F}/good.db --budget -1 -o p.dcplan", "usage", ["--budget"])
    add("plan-budget-word", f"{P} {F}/good.db --budget lots -o p.dcplan", "usage", ["--budget"])
    add("plan-budget-fraction", f"{P} {F}/good.db --budget 1.5GiB -o p.dcplan", "either",
        ["--budget"], keep=["p.dcplan"])
    add("plan-rounds-0-is-none", f"{P} {F}/good.db --rounds 0 -o p.dcplan", "ok",
        keep=["p.dcplan"])
    add("plan-rounds-neg", f"{P} {F}/good.db --rounds -1 -o p.dcplan", "usage", ["--rounds"])
    add("plan-round-steps-0", f"{P} {F}/good.db --rounds 1 --round-steps 0 -o p.dcplan", "usage",
        ["--round-steps"])
    add("plan-rounds-says-kept", f"{P} {F}/good.db --rounds 2 --round-steps 1 -o p.dcplan", "warn",
        ["round"], keep=["p.dcplan"], timeout=120,
        check=lambda d, o, e: None if re.search(r"kept|keeps|chose|fastest", o + e) else
        "does not say which round it kept")
    add("plan-policy-unknown", f"{P} {F}/good.db --policy fastest -o p.dcplan", "usage",
        ["fastest"])
    add("plan-trace-missing", f"{P} nope.db -o p.dcplan", "error", ["nope.db"])
    add("plan-trace-empty", f"{P} {F}/empty.db -o p.dcplan", "error", ["empty.db"])
    add("plan-trace-text", f"{P} {F}/text.db -o p.dcplan", "error", ["text.db"])
    add("plan-trace-truncated", f"{P} {F}/truncated.db -o p.dcplan", "error", ["truncated.db"])
    add("plan-trace-is-plan", f"{P} {F}/good.dcplan -o p.dcplan", "error", ["good.dcplan"])
    add("plan-trace-is-dir", f"{P} {F}/adir -o p.dcplan", "error", ["adir"])
    add("plan-trace-is-kineto", f"{P} {F}/k-empty.json -o p.dcplan", "error", ["k-empty.json"])
    add("plan-no-trace", f"{P} -o p.dcplan", "usage", ["trace"])
    add("plan-trace-and-synthetic", f"{P} {F}/good.db --synthetic -o p.dcplan", "usage",
        ["--synthetic"])
    add("plan-two-traces", f"{P} {F}/good.db {F}/two.db -o p.dcplan", "usage", ["two.db"])
    add("plan-unknown-flag", f"{P} {F}/good.db --fast -o p.dcplan", "usage", ["--fast"])
    add("plan-synthetic-world-0", f"{P} --synthetic --model tiny --world 0 --hardware cpu -o "
        "p.dcplan", "usage", ["--world"])
    add("plan-synthetic-world-neg", f"{P} --synthetic --model tiny --world -1 --hardware cpu -o "
        "p.dcplan", "usage", ["--world"])
    add("plan-synthetic-hardware-unknown", f"{P} --synthetic --model tiny --world 2 --hardware "
        "nosuch -o p.dcplan", "error", ["nosuch"])
    add("plan-synthetic-hardware-bad-json", f"{P} --synthetic --model tiny --world 2 --hardware "
        f"{F}/hw-bad.json -o p.dcplan", "error", ["hw-bad.json"])
    add("plan-synthetic-hardware-missing", f"{P} --synthetic --model tiny --world 2 --hardware "
        "missing.json -o p.dcplan", "error", ["missing.json"])
    add("plan-synthetic-hardware-negative", f"{P} --synthetic --model tiny --world 2 --hardware "
        f"{F}/hw-neg.json -o p.dcplan", "error", ["hw-neg.json"])
    add("plan-synthetic-layers-1e6", f"{S} --layers 1000000 -o p.dcplan", "error", ["--layers"],
        max_wall=10)
    add("plan-synthetic-hidden-2e9", f"{S} --hidden 2000000000 -o p.dcplan", "error",
        ["--hidden"], max_wall=10)
    add("plan-synthetic-70b-one-gpu", f"{P} --synthetic --model llama3-70b --world 1 --hardware "
        "h100-sxm -o p.dcplan", "error", ["budget"], timeout=120)
    add("plan-synthetic-budget-1k", f"{S} --budget 1KiB -o p.dcplan", "error", ["budget"])
    add("plan-synthetic-gpus-per-node-0", f"{S} --gpus-per-node 0 -o p.dcplan", "usage",
        ["--gpus-per-node"])
    add("plan-synthetic-gpus-per-node-3", f"{P} --synthetic --model tiny --world 8 --hardware "
        "h100-sxm --gpus-per-node 3 -o p.dcplan", "error", ["--gpus-per-node"])
    add("plan-synthetic-data-missing", f"{S} --data missing.bin -o p.dcplan", "error",
        ["missing.bin"])
    add("plan-synthetic-vocab-1", f"{S} --vocab 1 -o p.dcplan", "error", ["--vocab"])
    add("plan-synthetic-heads-0", f"{S} --heads 0 -o p.dcplan", "error", ["--heads"])
    add("plan-synthetic-dtype-f64", f"{S} --dtype f64 -o p.dcplan", "value", ["--dtype"])
    add("plan-print-hardware-unknown", f"{P} --hardware nosuch --print-hardware", "error",
        ["nosuch"])
    add("plan-print-hardware-default", f"{P} --print-hardware", "ok",
        check=lambda d, o, e: None if '"h100-sxm"' in o else "not the default profile")
    add("plan-cache-dir-is-file", f"touch cf && {P.replace(' --no-cache', '')} {F}/good.db "
        "--cache-dir cf -o p.dcplan", "warn", ["cf"], keep=["cf", "p.dcplan"])
    add("plan-cache-dir-read-only", f"mkdir rc && chmod 555 rc && "
        f"{P.replace(' --no-cache', '')} {F}/good.db --cache-dir rc -o p.dcplan", "warn", ["rc"],
        keep=["rc", "p.dcplan"], nobody=True)
    add("plan-from-plan-missing", f"{P} {F}/good.db --from-plan missing.dcplan -o p.dcplan",
        "error", ["missing.dcplan"])
    add("plan-from-plan-truncated", f"{P} {F}/good.db --from-plan {F}/truncated.dcplan -o "
        "p.dcplan", "error", ["truncated.dcplan"])
    add("plan-from-plan-other-program", f"{P} {F}/good.db --from-plan {F}/other.dcplan -o "
        "p.dcplan", "error", ["other.dcplan"])
    add("plan-from-plan-other-world", f"{P} {F}/good.db --from-plan {F}/two.dcplan -o p.dcplan",
        "either", ["two.dcplan"], keep=["p.dcplan"])
    add("plan-synthetic-report", f"{S} --report -o p.dcplan", "warn", ["predicted"],
        keep=["p.dcplan"])
    for name, sql, kind, words in CORRUPT:
        exp = "warn" if kind == "warn" else "error"
        setup = f"cp {F}/two.db c.db && sqlite3 c.db \"{sql}\""
        add(f"plan-rows-{name}", f"{setup} && {P} c.db -o p.dcplan", exp,
            (["c.db"] if exp == "error" else ["warning"]) + words,
            keep=["c.db"] + (["p.dcplan"] if exp == "warn" else []))
        add(f"trace-rows-{name}", f"{setup} && {T} summary c.db", exp,
            (["c.db"] if exp == "error" else ["warning"]) + words, keep=["c.db"])

    # ---- dc-run
    add("run-dir", f"{R} {F}/adir", "error", ["adir"])
    add("run-missing", f"{R} missing.dcplan", "error", ["missing.dcplan"])
    add("run-empty", f"{R} {F}/empty.dcplan", "error", ["empty.dcplan"])
    add("run-truncated", f"{R} {F}/truncated.dcplan", "error", ["truncated.dcplan", "truncated"])
    add("run-appended", f"{R} {F}/appended.dcplan", "error", ["appended.dcplan", "after the end"])
    add("run-corrupt", f"{R} {F}/corrupt.dcplan", "error", ["corrupt.dcplan"])
    add("run-newer", f"{R} {F}/newer.dcplan", "error", ["newer.dcplan", "newer"])
    add("run-older", f"{R} {F}/older.dcplan", "error", ["older.dcplan", "re-plan"])
    add("run-bad-magic", f"{R} {F}/magic.dcplan", "error", ["magic.dcplan"])
    add("run-trace-as-plan", f"{R} {F}/good.db", "error", ["good.db"])
    add("run-text-as-plan", f"{R} {F}/text.db", "error", ["text.db"])
    add("run-other-world", f"{R} {F}/good.dcplan --nproc 2", "error", ["--nproc"])
    add("run-other-world-3", f"{R} {F}/two.dcplan --nproc 3", "error", ["--nproc"])
    add("run-resume-other-program", f"{R} {F}/other.dcplan --resume {F}/ckpt", "error", ["ckpt"])
    add("run-resume-other-batch", f"{R0} {F}/two.dcplan --resume {F}/ckpt --steps 2", "error",
        ["ckpt"])
    add("run-init-from-other-program", f"{R} {F}/other.dcplan --init-from {F}/model", "error",
        ["model"])
    add("run-init-from-bad-config", f"{R} {F}/good.dcplan --init-from {F}/model-badconfig",
        "error", ["config.json"])
    add("run-init-from-cut", f"{R} {F}/good.dcplan --init-from {F}/model-cut", "error",
        ["model.safetensors"])
    add("run-init-from-missing", f"{R} {F}/good.dcplan --init-from nosuch", "error", ["nosuch"])
    add("run-init-from-empty-dir", f"{R} {F}/good.dcplan --init-from {F}/emptydir", "error",
        ["emptydir"])
    add("run-trace-is-plan", f"cp {F}/good.dcplan p.dcplan && {R} p.dcplan --trace p.dcplan",
        "error", ["p.dcplan"], keep=["p.dcplan"],
        check=lambda d, o, e: same_file(d + "/p.dcplan", F + "/good.dcplan"))
    add("run-trace-nodir", f"{R} {F}/good.dcplan --trace nodir/t.db", "error", ["nodir"])
    add("run-trace-dir", f"mkdir d && {R} {F}/good.dcplan --trace d", "error", ["d"], keep=["d"])
    add("run-trace-empty", f"{R} {F}/good.dcplan --trace ''", "usage", ["--trace"])
    add("run-steps-neg", f"{R} {F}/good.dcplan --steps -1", "value", ["--steps"])
    add("run-warmup-neg", f"{R} {F}/good.dcplan --warmup -1", "value", ["--warmup"])
    add("run-nproc-0", f"{R} {F}/good.dcplan --nproc 0", "usage", ["--nproc"])
    add("run-timeout-0", f"{R} {F}/good.dcplan --timeout 0", "usage", ["--timeout"])
    add("run-timeout-neg", f"{R} {F}/good.dcplan --timeout -1", "usage", ["--timeout"])
    add("run-save-empty", f"{R} {F}/good.dcplan --save ''", "usage", ["--save"])
    add("run-save-file", f"touch sf && {R} {F}/good.dcplan --save sf", "error", ["sf"],
        keep=["sf"])
    add("run-save-every-neg", f"{R} {F}/good.dcplan --save c --save-every -1", "usage",
        ["--save-every"])
    add("run-keep-0", f"{R} {F}/good.dcplan --save c --keep 0", "usage", ["--keep"])
    add("run-save-every-without-save", f"{R} {F}/good.dcplan --save-every 2", "value",
        ["--save"])
    add("run-resume-missing", f"{R} {F}/good.dcplan --resume nosuch", "error", ["nosuch"])
    add("run-resume-empty-dir", f"{R} {F}/good.dcplan --resume {F}/emptydir", "either",
        ["emptydir"])
    add("run-resume-bad-manifest", f"cp -r {F}/ckpt c && for m in c/*/manifest.json; do "
        f"echo garbage > $m; done && {R0} {F}/good.dcplan --resume c --steps 2", "error", ["c/"],
        keep=["c"])
    add("run-resume-cut-shard", f"cp -r {F}/ckpt c && for s in c/*/rank-*.safetensors; do "
        f"truncate -s 100 $s; done && {R0} {F}/good.dcplan --resume c --steps 2", "error", ["c/"],
        keep=["c"])
    add("run-data-missing", f"{R} {F}/v256.dcplan --data missing.bin", "error", ["missing.bin"])
    add("run-data-odd", f"{R} {F}/v256.dcplan --data {F}/odd.bin", "error", ["odd.bin"])
    add("run-data-ids-over-vocab", f"{R} {F}/v256.dcplan --data {F}/big-ids.bin", "error",
        ["big-ids.bin"])
    add("run-data-changed", f"cp {F}/data.dcplan p.dcplan && printf '\\x07\\x00' | dd "
        f"of={F}/tokens.bin bs=1 seek=0 conv=notrunc 2>/dev/null; {R} p.dcplan; rc=$?; "
        f"cp {F}/tokens-orig.bin {F}/tokens.bin; exit $rc", "error", ["tokens.bin"],
        keep=["p.dcplan"])
    add("run-data-deleted", f"cp {F}/tokens.bin t2.bin && {P} --synthetic --model tiny --vocab 256 "
        "--data $PWD/t2.bin --world 1 --hardware cpu --quiet -o p.dcplan && rm t2.bin && "
        f"{R} p.dcplan", "error", ["t2.bin"], keep=["p.dcplan"])
    add("run-eval-data-missing", f"{R} {F}/good.dcplan --eval-data missing.bin", "error",
        ["missing.bin"])
    add("run-eval-every-without-data", f"{R} {F}/good.dcplan --eval-every 5", "value",
        ["--eval-data"])
    add("run-eval-batches-0", f"{R} {F}/v256.dcplan --eval-data {F}/tokens.bin --eval-batches 0",
        "usage", ["--eval-batches"])
    add("run-eval-data-short", f"{R} {F}/v256.dcplan --eval-data {F}/short.bin", "error",
        ["short.bin"])
    add("run-export-existing", f"mkdir e && {R} {F}/good.dcplan --export e", "error", ["e"],
        keep=["e"])
    add("run-export-nodir", f"{R} {F}/good.dcplan --export nodir/x", "error", ["nodir"])
    add("run-dump-grads-file", f"touch g && {R} {F}/good.dcplan --dump-grads g", "error", ["g"],
        keep=["g"])
    add("run-device-memory-1k", f"{R} {F}/good.dcplan --device-memory 1KiB", "error",
        ["--device-memory"])
    add("run-threads-1000", f"{R} {F}/good.dcplan --threads-per-rank 1000", "error",
        ["--threads-per-rank"])
    add("run-backend-cuda", f"{DC}/dc-run {F}/good.dcplan --backend cuda --steps 1", "error",
        ["cuda"])
    add("run-no-plan", f"{DC}/dc-run --steps 1", "usage", ["plan"])
    add("run-two-plans", f"{R} {F}/good.dcplan {F}/two.dcplan", "usage", ["two.dcplan"])
    add("run-unknown-flag", f"{R} {F}/good.dcplan --no-such-flag", "usage", ["--no-such-flag"])
    add("run-world-size-abc", f"WORLD_SIZE=abc RANK=0 {R} {F}/good.dcplan", "error",
        ["WORLD_SIZE"])
    add("run-nproc-vs-world-size", f"WORLD_SIZE=2 RANK=0 {R} {F}/two.dcplan --nproc 4 "
        "--rendezvous r", "error", ["--nproc", "WORLD_SIZE"])
    add("run-rank-over", f"WORLD_SIZE=2 RANK=5 {R} {F}/two.dcplan", "error", ["RANK"])
    add("run-rank-neg", f"WORLD_SIZE=2 RANK=-1 {R} {F}/two.dcplan", "error", ["RANK"])
    add("run-world-size-vs-plan", f"WORLD_SIZE=1 RANK=0 {R} {F}/two.dcplan", "error",
        ["WORLD_SIZE"])
    add("run-timeout5-rank1-alone", f"WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 "
        f"MASTER_PORT={port} {R} {F}/two.dcplan --timeout 5", "error", ["rank 0"], max_wall=15)
    add("run-timeout5-rank0-alone", f"WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 "
        f"MASTER_PORT={port} {R} {F}/two.dcplan --timeout 5", "error", ["rank"], max_wall=15)
    add("run-timeout5-rdzv-dir-alone", f"WORLD_SIZE=2 RANK=1 {R} {F}/two.dcplan --timeout 5 "
        "--rendezvous r", "error", ["rank"], keep=["r"], max_wall=15)
    add("run-master-port-in-use", "python3 -c 'import socket,time; s=socket.socket(); "
        f"s.bind((\"127.0.0.1\",{port + 1})); s.listen(); time.sleep(20)' & sleep 0.5; "
        f"WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT={port + 1} {R} {F}/two.dcplan "
        "--timeout 5; rc=$?; kill %1; exit $rc", "error", [str(port + 1)], max_wall=15)
    add("run-master-port-abc", f"WORLD_SIZE=2 RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=abc {R} "
        f"{F}/two.dcplan --timeout 5", "error", ["MASTER_PORT"])
    add("run-rendezvous-reuse", f"{R} {F}/two.dcplan --nproc 2 --rendezvous r && "
        f"{R} {F}/two.dcplan --nproc 2 --rendezvous r", "ok", keep=["r"])
    add("run-rendezvous-reuse-torchrun-style",
        "for i in 1 2; do "
        f"WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 {R} {F}/two.dcplan --rendezvous r --timeout 20 --quiet "
        f"& p0=$!; WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 {R} {F}/two.dcplan --rendezvous r --timeout 20 "
        "--quiet; r1=$?; wait $p0; r0=$?; [ $r0 = 0 ] && [ $r1 = 0 ] || exit 1; done", "ok",
        keep=["r"])
    add("run-rendezvous-file", f"touch rf && {R} {F}/two.dcplan --nproc 2 --rendezvous rf",
        "error", ["rf"], keep=["rf"])
    # --nproc meets in a private directory of its own (README): DC_RENDEZVOUS_DIR is for outside
    # launchers' ranks, so the run goes on.
    add("run-rendezvous-env-file-nproc", f"touch rf && DC_RENDEZVOUS_DIR=$PWD/rf {R} "
        f"{F}/two.dcplan --nproc 2", "either", ["rf"], keep=["rf"])
    add("run-rendezvous-env-file-rank", f"touch rf && DC_RENDEZVOUS_DIR=$PWD/rf WORLD_SIZE=2 "
        f"RANK=1 {R} {F}/two.dcplan --timeout 5", "error", ["rf"], keep=["rf"])
    add("run-rendezvous-unwritable", f"mkdir ro && chmod 555 ro && {R} {F}/two.dcplan --nproc 2 "
        "--rendezvous ro --timeout 10", "error", ["ro"], keep=["ro"], nobody=True, max_wall=8)
    for sig, code in (("INT", 130), ("TERM", 143), ("HUP", 129)):
        add(f"run-nproc2-sig{sig}", f"{DC}/dc-run --backend cpu {F}/two.dcplan --nproc 2 "
            "--steps 100000", "signal", ready="step", sig=getattr(signal, "SIG" + sig))
    add("run-nproc2-sigKILL", f"{DC}/dc-run --backend cpu {F}/two.dcplan --nproc 2 --steps 100000",
        "signal", ready="step", sig=signal.SIGKILL,
        after=f"{DC}/dc-run --backend cpu {F}/two.dcplan --nproc 2 --steps 1 --quiet")
    add("run-1rank-sigTERM", f"{DC}/dc-run --backend cpu {F}/good.dcplan --steps 100000",
        "signal", ready="step", sig=signal.SIGTERM)
    add("run-nproc2-trace-sigTERM", f"{DC}/dc-run --backend cpu {F}/two.dcplan --nproc 2 "
        "--steps 100000 --trace t.db", "signal", ready="step", sig=signal.SIGTERM, keep=["t.db"],
        check=lambda d, o, e: trace_incomplete(d, DC, "t.db"))
    add("run-nproc2-save-sigINT", f"{DC}/dc-run --backend cpu {F}/two.dcplan --nproc 2 "
        "--steps 100000 --save c --save-every 1", "signal", ready="step", sig=signal.SIGINT,
        keep=["c", "c/*"])

    # ---- dc-trace
    add("trace-summary-missing", f"{T} summary missing.db", "error", ["missing.db"])
    add("trace-summary-dir", f"{T} summary {F}/adir", "error", ["adir"])
    add("trace-summary-empty", f"{T} summary {F}/empty.db", "error", ["empty.db"])
    add("trace-summary-text", f"{T} summary {F}/text.db", "error", ["text.db"])
    add("trace-summary-truncated", f"{T} summary {F}/truncated.db", "error", ["truncated.db"])
    add("trace-summary-plan", f"{T} summary {F}/good.dcplan", "ok",
        check=lambda d, o, e: None if "(plan)" in o else "not read as a plan")
    add("trace-perfetto-o-input", f"cp {F}/good.db t.db && {T} perfetto t.db -o t.db", "error",
        ["t.db"], keep=["t.db"], check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("trace-memory-o-input", f"cp {F}/good.db t.db && {T} memory t.db -o t.db", "error",
        ["t.db"], keep=["t.db"], check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("trace-memory-rank-neg", f"{T} memory {F}/two.db --rank -1 -o m.svg", "usage", ["--rank"])
    add("trace-memory-rank-5", f"{T} memory {F}/two.db --rank 5 -o m.svg", "error", ["rank 5"])
    add("trace-memory-step-99", f"{T} memory {F}/two.db --step 99 -o m.svg", "error", ["99"])
    add("trace-memory-step-neg", f"{T} memory {F}/two.db --step -1 -o m.svg", "usage",
        ["--step"])
    add("trace-memory-o-empty", f"{T} memory {F}/two.db -o ''", "usage", ["--output"])
    add("trace-memory-o-nodir", f"{T} memory {F}/two.db -o nodir/m.svg", "error", ["nodir"])
    add("trace-perfetto-o-nodir", f"{T} perfetto {F}/two.db -o nodir/x.json", "error", ["nodir"])
    add("trace-perfetto-o-dir", f"mkdir d && {T} perfetto {F}/two.db -o d", "error", ["d"],
        keep=["d"])
    add("trace-perfetto-o-empty", f"{T} perfetto {F}/two.db -o ''", "usage", ["--output"])
    add("trace-perfetto-plan", f"{T} perfetto {F}/good.dcplan -o x.json", "either",
        ["good.dcplan"], keep=["x.json"])
    add("trace-perfetto-truncated-plan", f"{T} perfetto {F}/truncated.dcplan -o x.json", "error",
        ["truncated.dcplan"])
    add("trace-diff-missing-plan", f"{T} diff {F}/good.db missing.dcplan", "error",
        ["missing.dcplan"])
    add("trace-diff-other-world", f"{T} diff {F}/good.db {F}/two.dcplan", "warn",
        ["warning", "two.dcplan", "not of the same program"])
    add("trace-diff-profile-missing", f"{T} diff {F}/good.db {F}/good.dcplan --profile nope.db",
        "error", ["nope.db"])
    add("trace-diff-other-program", f"{T} diff {F}/good.db {F}/other.dcplan", "warn",
        ["warning", "other.dcplan", "not of the same program"])
    add("trace-diff-same-program", f"{T} diff {F}/good.db {F}/good.dcplan", "ok",
        check=lambda d, o, e: "warning" in e and "warned on one program" or None)
    add("trace-top-0", f"{T} summary {F}/good.db --top 0", "ok")
    add("trace-top-neg", f"{T} summary {F}/good.db --top -1", "usage", ["--top"])
    add("trace-no-subcommand", f"{T}", "usage", ["subcommand"])
    add("trace-unknown-subcommand", f"{T} show {F}/good.db", "usage", ["show"])
    add("trace-merge-no-parts", f"{T} merge -o t.db", "usage", ["parts"])
    add("trace-merge-missing", f"{T} merge nope.part -o t.db", "error", ["nope.part"])
    add("trace-merge-text", f"{T} merge {F}/text.db -o t.db", "error", ["text.db"])
    add("trace-merge-o-input", f"cp {F}/good.db t.db && {T} merge t.db -o t.db", "error",
        ["t.db"], keep=["t.db"], check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("trace-merge-o-existing-dir", f"mkdir d && {T} merge {F}/good.db -o d", "error", ["d"],
        keep=["d"])
    add("trace-kineto-1e300", f"{T} summary {F}/k-1e300.json", "error", ["k-1e300.json", "ts"])
    add("trace-kineto-1e400", f"{T} summary {F}/k-1e400.json", "error", ["k-1e400.json"])
    add("trace-kineto-1e300-perfetto", f"{T} perfetto {F}/k-1e300.json -o x.json", "error",
        ["k-1e300.json"])
    add("trace-kineto-negative-dur", f"{T} summary {F}/k-negdur.json", "either",
        ["k-negdur.json"])
    add("trace-kineto-huge-dur", f"{T} summary {F}/k-hugedur.json", "error", ["k-hugedur.json"])
    add("trace-kineto-empty", f"{T} summary {F}/k-empty.json", "error", ["k-empty.json"])
    add("trace-kineto-no-events", f"{T} summary {F}/k-noevents.json", "error",
        ["k-noevents.json"])
    add("trace-kineto-list", f"{T} summary {F}/k-list.json", "error", ["k-list.json"])
    add("trace-kineto-string-ts", f"{T} summary {F}/k-string.json", "error", ["k-string.json"])
    add("trace-kineto-bad-gzip", f"{T} summary {F}/k-bad.json.gz", "error", ["k-bad.json.gz"])
    add("trace-memory-kineto-1e300", f"{T} memory {F}/k-1e300.json -o m.svg", "error",
        ["k-1e300.json"])
    add("trace-summary-two-db-ok", f"{T} summary {F}/two.db --json", "ok")

    # ---- dc-calibrate
    add("calibrate-nothing", f"{K} -o c.json", "error", ["nothing to fit"])
    add("calibrate-base-unknown", f"{DC}/dc-calibrate --base nosuch --trace {F}/good.db -o c.json",
        "error", ["nosuch"])
    add("calibrate-base-bad-json", f"{DC}/dc-calibrate --base {F}/hw-bad.json --trace "
        f"{F}/good.db -o c.json", "error", ["hw-bad.json"])
    add("calibrate-trace-missing", f"{K} --trace missing.db -o c.json", "error", ["missing.db"])
    add("calibrate-trace-text", f"{K} --trace {F}/text.db -o c.json", "error", ["text.db"])
    add("calibrate-trace-csv", f"{K} --trace {F}/columns.csv -o c.json", "error", ["columns.csv"])
    add("calibrate-nccl-missing", f"{K} --nccl-tests missing.txt -o c.json", "error",
        ["missing.txt"])
    add("calibrate-nccl-empty", f"{K} --nccl-tests {F}/empty.txt -o c.json", "error",
        ["empty.txt"])
    add("calibrate-nccl-norows", f"{K} --nccl-tests {F}/ag-norows.txt -o c.json", "error",
        ["ag-norows.txt"])
    add("calibrate-nccl-nan", f"{K} --nccl-tests {F}/ag-nan.txt -o c.json", "error",
        ["ag-nan.txt"])
    add("calibrate-nccl-negative-time", f"{K} --nccl-tests {F}/ag-neg.txt -o c.json", "error",
        ["ag-neg.txt"])
    add("calibrate-nccl-text", f"{K} --nccl-tests {F}/ag-text.txt -o c.json", "error",
        ["ag-text.txt"])
    for csv in ("columns", "policy", "nan", "negative", "preset", "world0", "words", "short",
                "header", "empty"):
        add(f"calibrate-steps-{csv}", f"{K} --steps {F}/{csv}.csv -o c.json", "error",
            [f"{csv}.csv"])
    add("calibrate-fit-steps-unknown", f"{K} --steps {F}/good.csv --fit-steps warp_speed -o "
        "c.json", "error", ["warp_speed"])
    add("calibrate-o-input", f"cp {F}/good.db t.db && {K} --trace t.db -o t.db", "error",
        ["t.db"], keep=["t.db"], check=lambda d, o, e: same_file(d + "/t.db", F + "/good.db"))
    add("calibrate-o-empty", f"{K} --trace {F}/good.db -o ''", "usage", ["--output"])
    add("calibrate-o-nodir", f"{K} --trace {F}/good.db -o nodir/c.json", "error", ["nodir"])
    add("calibrate-o-dir", f"mkdir d && {K} --trace {F}/good.db -o d", "error", ["d"],
        keep=["d"])
    add("calibrate-o-base-file", f"cp {F}/hw.json h.json && {DC}/dc-calibrate --base h.json "
        f"--trace {F}/good.db -o h.json", "error", ["h.json"], keep=["h.json"],
        check=lambda d, o, e: same_file(d + "/h.json", F + "/hw.json"))
    add("calibrate-unknown-flag", f"{K} --fit everything", "usage", ["--fit"])
    add("calibrate-name-empty", f"{K} --steps {F}/good.csv --name '' -o c.json", "either",
        ["--name"], keep=["c.json"])
    return out


def same_file(a, b):
    with open(a, "rb") as x, open(b, "rb") as y:
        return None if x.read() == y.read() else f"{a} was changed"


def trace_incomplete(d, DC, name):
    path = os.path.join(d, name)
    if not os.path.exists(path):
        return f"{name} was not written"
    r = subprocess.run([f"{DC}/dc-trace", "summary", path], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        return f"dc-trace summary {name}: {r.stderr.strip()}"
    if "incomplete" not in r.stdout + r.stderr:
        return f"{name} is not marked incomplete"
    return None


def snapshot(root):
    found = set()
    for base, dirs, files in os.walk(root):
        for n in dirs + files:
            found.add(os.path.relpath(os.path.join(base, n), root))
    return found


def case_processes(tag):
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"DC_SWEEP_CASE={tag}".encode() in f.read().split(b"\0"):
                    pids.append(int(p))
        except OSError:
            pass
    return pids


def allowed(rel, keep):
    import fnmatch
    for k in keep:
        if rel == k or rel.startswith(k + "/") or fnmatch.fnmatch(rel, k):
            return True
    return False


def run_case(c, root, env_base):
    d = os.path.join(root, c.name)
    tmp = os.path.join(root, c.name + ".tmp")
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(d)
    os.makedirs(tmp)
    env = dict(env_base, TMPDIR=tmp, DC_SWEEP_CASE=c.name)
    cmd = ["bash", "-c", c.cmd]
    if c.nobody:
        os.chmod(d, 0o777)
        os.chmod(tmp, 0o777)
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", c.cmd]
    before_tmp = set(glob.glob("/tmp/dc-rendezvous-*"))
    outp, errp = d + ".out", d + ".err"
    start = time.monotonic()
    with open(outp, "w") as o, open(errp, "w") as e:
        proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=o, stderr=e, start_new_session=True)
        rc, hung, sent = None, False, None
        while True:
            rc = proc.poll()
            if rc is not None:
                break
            if time.monotonic() - start > c.timeout:
                hung = True
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                break
            if c.sig is not None and sent is None:
                if isinstance(c.ready, (int, float)):
                    ready = time.monotonic() - start > c.ready
                else:
                    with open(outp) as so, open(errp) as se:
                        ready = c.ready in so.read() + se.read()
                if ready:
                        # To the launcher alone (bash execs it: one command), as kill PID does.
                        os.kill(proc.pid, c.sig)
                        sent = time.monotonic()
            time.sleep(0.05)
    wall = time.monotonic() - start
    if c.sig is not None and sent is not None:
        wall = time.monotonic() - sent
    # Ranks that outlive their launcher: give them 3 s (the launcher's grace), then count.
    deadline = time.monotonic() + (8 if c.sig == signal.SIGKILL else 3)
    survivors = case_processes(c.name)
    while survivors and time.monotonic() < deadline:
        time.sleep(0.1)
        survivors = case_processes(c.name)
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if c.after:
        subprocess.run(["bash", "-c", c.after], cwd=d, env=env, capture_output=True, timeout=120)
    with open(outp, errors="replace") as f:
        out = f.read()
    with open(errp, errors="replace") as f:
        err = f.read()
    left = sorted(x for x in snapshot(d) if not allowed(x, c.keep))
    left += sorted("$TMPDIR/" + x for x in snapshot(tmp))
    # Every case has its own TMPDIR, which dc honours; a new /tmp/dc-rendezvous-* is another
    # session's (tests of other worktrees share /tmp), so it is noted, not counted.
    tmp_noted = sorted(set(glob.glob("/tmp/dc-rendezvous-*")) - before_tmp)
    err_lines = [l for l in err.splitlines() if l.strip()]
    # A word may be a tuple: any of its spellings.
    words_ok = all(any(x in out + err for x in (w if isinstance(w, tuple) else (w,)))
                   for w in c.words)
    check_msg = None
    if c.check and not hung:
        try:
            check_msg = c.check(d, out, err)
        except Exception as ex:  # a check that cannot read its file is a wrong result
            check_msg = f"check failed: {ex}"
    # Classify, worst first.
    why = ""
    signalled = rc < 0 or (rc >= 128 and c.sig is None)
    if hung:
        cls, why = "hung", f"over {c.timeout} s"
    elif (signalled and c.sig is None) or CRASH_TEXT.search(err) or (rc != 0 and not err_lines
                                                                     and c.sig is None):
        cls, why = "crashed", f"exit {rc}" + (", empty stderr" if not err_lines else "")
    elif c.expect in ("usage", "error", "value") and rc == 0:
        cls, why = "silently wrong", "exit 0"
    elif check_msg:
        cls, why = "silently wrong", check_msg
    elif c.expect == "ok" and rc != 0:
        cls, why = "unclear", f"exit {rc}: " + (err_lines[-1] if err_lines else "")
    elif c.expect == "warn" and (rc != 0 or not words_ok):
        cls = "silently wrong" if rc == 0 else "unclear"
        why = f"exit {rc}, missing {c.words}" if rc == 0 else f"exit {rc}: " + (
            err_lines[-1] if err_lines else "")
    elif left or survivors:
        cls, why = "partial", "left " + ", ".join(left[:4]) + (
            f"; {len(survivors)} process(es) survived" if survivors else "")
    elif c.expect == "signal":
        want = 128 + c.sig
        if sent is None:
            cls, why = "unclear", "never became ready"
        elif c.sig == signal.SIGKILL:
            cls = "clear"
        elif rc != want and rc != -c.sig:
            cls, why = "unclear", f"exit {rc}, expected {want}"
        else:
            cls = "clear"
    elif c.expect == "either" and rc == 0:
        cls = "clear"
    elif c.expect in ("usage", "error", "value", "either") or (c.expect in ("ok", "warn") and rc != 0):
        want = 2 if c.expect == "usage" else 1
        if c.expect == "value" and rc in (1, 2):
            want = rc
        if rc != want:
            cls, why = "unclear", f"exit {rc}, expected {want}"
        elif not words_ok:
            cls, why = "unclear", f"does not name {c.words}"
        elif want == 1 and len(err_lines) != 1:
            cls, why = "unclear", f"{len(err_lines)} lines on stderr"
        else:
            cls = "clear"
    else:
        cls = "clear"
    if c.max_wall and wall > c.max_wall and cls == "clear":
        cls, why = "unclear", f"{wall:.1f} s before the error (over {c.max_wall} s)"
    return dict(name=c.name, command=c.cmd, expect=c.expect, exit=rc, wall_s=round(wall, 2),
                stderr_lines=len(err_lines), names=words_ok,
                hint=bool(HINT.search(err_lines[-1])) if err_lines else False,
                message=err_lines[-1][:300] if err_lines else "", leftovers=left,
                tmp_noted=tmp_noted,
                survivors=len(survivors), cls=cls, why=why)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    # A shell without job control starts a background job (`fault_sweep.sh build &`) with SIGINT
    # and SIGQUIT ignored, and exec keeps them ignored: every case would start as a nohup'd
    # process, which dc rightly leaves alone (collect-1rank-sigINT then runs its 100000 steps).
    # The cases start as a user's terminal starts them: with the default dispositions (a handled
    # signal is default again after exec; the sweep itself still stops on Ctrl-C).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    DC = os.path.abspath(os.path.join(a.build, "tools"))
    for t in ("dc-collect", "dc-plan", "dc-run", "dc-trace", "dc-calibrate"):
        if not os.access(f"{DC}/{t}", os.X_OK):
            raise SystemExit(f"{DC}/{t}: not built; build the tools first")
    root = tempfile.mkdtemp(prefix="dc-fault-sweep.")
    os.chmod(root, 0o755)
    F = os.path.join(root, "fixtures")
    env = dict(os.environ, DC_CPU_POISON="1")
    env.pop("TMPDIR", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "DC_RENDEZVOUS_DIR", "DC_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
              "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    t0 = time.monotonic()
    make_fixtures(F, DC)
    print(f"fixtures in {time.monotonic() - t0:.1f} s ({F})", flush=True)
    results = []
    counts = {k: 0 for k in CLASSES}
    for c in cases(F, DC, free_port()):
        if a.only and a.only not in c.name:
            continue
        r = run_case(c, root, env)
        results.append(r)
        counts[r["cls"]] += 1
        print(f"{r['cls']:15s} {r['name']:40s} exit {r['exit']!s:4s} {r['wall_s']:6.2f} s  "
              f"{r['why'] or r['message'][:110]}", flush=True)
    print(f"\n{len(results)} case(s) tried: " + ", ".join(f"{counts[k]} {k}" for k in CLASSES))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(counts=counts, tried=len(results), results=results), f, indent=1)
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if counts["clear"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

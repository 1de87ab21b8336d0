// Starting ranks. `--nproc N` on one machine re-executes this program N times with the rank
// variables set and a private rendezvous directory; an outside launcher (torchrun --no-python,
// Slurm, an mpirun wrapper) sets the same variables itself and names a shared directory.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "schemas/status.h"

namespace dc {

struct RankEnv {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  std::string rendezvous_dir;  // the file store's shared directory; empty for TCP or one rank
  std::string master_addr;     // the TCP rendezvous, where rendezvous_dir is empty
  int master_port = 0;
  std::string bind_host = "127.0.0.1";
  bool under_local_launcher = false;  // started by LaunchLocal (stderr goes to a file)
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK (or SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), the
// rendezvous directory (`rendezvous_flag`, else DC_RENDEZVOUS_DIR), else the TCP rendezvous
// (MASTER_ADDR and DC_MASTER_PORT, else MASTER_PORT, plus one under torchrun's agent store),
// and the address to listen
// on (DC_BIND_ADDR; else MASTER_ADDR's loopback-ness decides: loopback or unset -> 127.0.0.1,
// else this host's name). No variables: a world of one. A variable set to anything but a whole
// number is an error naming it.
StatusOr<RankEnv> RankEnvFromEnvironment(const std::string& rendezvous_flag);

// True when this process was started by LaunchLocal or an outside launcher as one rank
// (WORLD_SIZE or SLURM_NTASKS set, to anything: RankEnvFromEnvironment checks the values).
bool IsRankProcess();

// The --nproc flag against the launcher's variables: outside LaunchLocal's ranks, an --nproc that
// differs from WORLD_SIZE (or SLURM_NTASKS) is refused rather than ignored. `nproc` 0: not given.
// Reads the variables itself, so that it can run before RankEnvFromEnvironment's rendezvous
// checks (a WORLD_SIZE that is not a number is named here too).
Status CheckNprocAgainstEnvironment(int nproc);
// This run's identity, so that a rendezvous directory used before holds nothing this run reads:
// DC_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID (with its restart count), else Slurm's
// SLURM_JOB_ID (with SLURM_STEP_ID); empty when none is set. Only [A-Za-z0-9._-] are kept.
std::string RunIdFromEnvironment();

// Where this process writes per-step progress lines: stderr, or for rank 0 under LaunchLocal
// the launcher's stderr (its own is a file); -1 for the other ranks it starts.
int ProgressFd();

// How long the ranks of a traced run get to stop after a stop signal: the step they are in, then
// the trace's merge.
inline constexpr std::chrono::milliseconds kTracedStopGrace{30000};

struct LaunchOptions {
  int nproc = 2;
  // After the first rank fails, how long the others get to stop before they are killed.
  std::chrono::milliseconds grace{10000};
  // After SIGINT/SIGTERM/SIGHUP reach the launcher and are passed on to the ranks, how long they
  // get to stop before they are killed.
  std::chrono::milliseconds stop_grace{3000};
  std::string program = "dc";  // for messages
  // Called when ranks failed or had to be killed, before the rendezvous directory (the ranks'
  // DC_RENDEZVOUS_DIR, and the run id they were given) is removed: what a run can keep of its
  // work, and the place to remove what killed ranks (process ids `rank_pids`) left half-written.
  // Returns a sentence for the message, or "".
  std::function<std::string(const std::string& rendezvous_dir, const std::string& run_id,
                            const std::vector<int>& rank_pids)>
      salvage;
};

// Runs `argv` (this program's own arguments) as `nproc` ranks and waits for them, with a fresh
// rendezvous directory in $TMPDIR (else /tmp) that is removed on every way out. Rank 0's stdout
// is passed through; every rank's stderr is kept, and on success rank 0's is replayed. Returns 0
// when every rank succeeded; otherwise prints one line naming the first rank that failed and
// why, stops the rest, and returns 1. SIGINT, SIGTERM and SIGHUP are passed on to the ranks,
// which are killed if they have not stopped after `stop_grace`; then it returns 128 + signal.
// Ranks die with the launcher even when it is killed with SIGKILL.
int LaunchLocal(const LaunchOptions& options, const std::vector<std::string>& argv);

}  // namespace dc

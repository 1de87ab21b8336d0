// A key-value store over TCP for the ranks' rendezvous, so that ranks meet at MASTER_ADDR:
// MASTER_PORT (as torchrun and Slurm users set them) without a shared file system. Rank 0 serves
// it for as long as the ranks connect (TcpStoreServer); every rank, rank 0 included, is a client
// (TcpStore). A client first says which run it belongs to and how many ranks that run has, so a
// server of another run on the same port is refused by name instead of read.
//
// Wire format (all integers little-endian): a request is u32 length, then u8 op and its fields,
// each field u32 length + bytes; a reply is u32 length, u8 status (0 ok, 1 error), then one field
// (the value, or the error's text). GET blocks on the server until the key is set. Both sides
// bound every length (TcpStoreLimits) and treat the peer as hostile.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "schemas/status.h"

namespace dc {

struct TcpStoreLimits {
  int64_t max_key_bytes = 4096;
  int64_t max_value_bytes = int64_t{64} << 20;
  int max_connections = 4096;
};

// Serves the store on `port` of every local address until destroyed. `run_id` and
// `world_size` must match each client's. Thread-safe; its threads stop in the destructor.
class TcpStoreServer {
 public:
  static StatusOr<std::unique_ptr<TcpStoreServer>> Start(int port, const std::string& run_id,
                                                         int world_size,
                                                         const TcpStoreLimits& limits = {});
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;

  struct State;

 private:
  explicit TcpStoreServer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// One rank's connection to the store. Not thread-safe.
class TcpStore {
 public:
  // Connects to host:port, retrying until `timeout` (the server may start after this rank), and
  // introduces this rank's run.
  static StatusOr<std::unique_ptr<TcpStore>> Connect(const std::string& host, int port,
                                                     const std::string& run_id, int world_size,
                                                     std::chrono::milliseconds timeout,
                                                     const TcpStoreLimits& limits = {});
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  Status Set(const std::string& key, const std::vector<char>& value);
  // Waits up to `timeout` for `key` to be set, then returns its value.
  StatusOr<std::vector<char>> Get(const std::string& key, std::chrono::milliseconds timeout);

 private:
  TcpStore(int fd, std::string where, TcpStoreLimits limits);
  StatusOr<std::vector<char>> Call(uint8_t op, const std::vector<std::string>& fields,
                                   std::chrono::milliseconds timeout);
  int fd_;
  std::string where_;  // "host:port", for messages
  TcpStoreLimits limits_;
};

// True when connected socket `fd`'s two ends are one. A client that retries a port in the
// ephemeral range on its own host before anything listens there can be given that very port as
// its source and connect to itself (TCP's simultaneous open); TcpStore::Connect then retries.
bool ConnectedToItself(int fd);

// One rank's place in a TCP rendezvous: rank 0 serves the store and every rank, rank 0 included,
// connects to it. Rank 0 must keep this until every rank has read what it needs (the caller's
// barrier or communicator join); then destroying it stops the server. Errors name the rank and
// say what to set.
struct TcpRendezvous {
  std::unique_ptr<TcpStoreServer> server;  // rank 0 only
  std::unique_ptr<TcpStore> store;

  static StatusOr<TcpRendezvous> Join(const std::string& host, int port, const std::string& run_id,
                                      int world_size, int rank, std::chrono::milliseconds timeout);
};

}  // namespace dc

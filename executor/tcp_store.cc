#include "executor/tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

namespace dc {
namespace {

enum Op : uint8_t { kHello = 1, kSet = 2, kGet = 3 };
enum Reply : uint8_t { kOk = 0, kFailed = 1 };

using Clock = std::chrono::steady_clock;

std::string Errno() { return std::strerror(errno); }

// Milliseconds left until `deadline` for poll(): -1 waits without end.
int PollMs(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

// Reads exactly `size` bytes; an error, end of stream or the deadline is a failed Status.
Status ReadExact(int fd, char* out, size_t size, Clock::time_point deadline) {
  size_t done = 0;
  while (done < size) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, PollMs(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return Status::Error("poll: " + Errno());
    if (ready == 0) return Status::Error("timed out");
    const ssize_t n = ::recv(fd, out + done, size - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Error("recv: " + Errno());
    if (n == 0) return Status::Error("the connection was closed");
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Error("send: " + Errno());
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// A frame: u32 length, then the body.
std::string Frame(const std::string& body) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(body.size()));
  return out + body;
}

std::string Body(uint8_t head, const std::vector<std::string>& fields) {
  std::string body(1, static_cast<char>(head));
  for (const std::string& f : fields) {
    PutU32(&body, static_cast<uint32_t>(f.size()));
    body += f;
  }
  return body;
}

// Reads one frame of at most `max_bytes`.
StatusOr<std::string> ReadFrame(int fd, int64_t max_bytes, Clock::time_point deadline) {
  char size[4];
  DC_RETURN_IF_ERROR(ReadExact(fd, size, 4, deadline));
  const uint32_t bytes = GetU32(size);
  if (bytes == 0 || bytes > max_bytes) {
    return Status::Error("a message of " + std::to_string(bytes) + " bytes (at most " +
                         std::to_string(max_bytes) + ")");
  }
  std::string body(bytes, '\0');
  DC_RETURN_IF_ERROR(ReadExact(fd, body.data(), bytes, deadline));
  return body;
}

// The fields after the head byte; every length checked against the body.
StatusOr<std::vector<std::string>> Fields(const std::string& body) {
  std::vector<std::string> fields;
  size_t at = 1;
  while (at < body.size()) {
    if (body.size() - at < 4) return Status::Error("a field's length is cut off");
    const uint32_t n = GetU32(body.data() + at);
    at += 4;
    if (n > body.size() - at) return Status::Error("a field runs past the message");
    fields.push_back(body.substr(at, n));
    at += n;
  }
  return fields;
}

int64_t MaxFrameBytes(const TcpStoreLimits& limits) {
  constexpr int64_t kOverheadBytes = 64;
  return limits.max_key_bytes + limits.max_value_bytes + kOverheadBytes;
}

}  // namespace

bool ConnectedToItself(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t local_size = sizeof(local), peer_size = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0) {
    return false;
  }
  if (local.ss_family != peer.ss_family) return false;
  if (local.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(local);
    const auto& b = reinterpret_cast<const sockaddr_in&>(peer);
    return a.sin_port == b.sin_port && a.sin_addr.s_addr == b.sin_addr.s_addr;
  }
  if (local.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(local);
    const auto& b = reinterpret_cast<const sockaddr_in6&>(peer);
    return a.sin6_port == b.sin6_port &&
           std::memcmp(&a.sin6_addr, &b.sin6_addr, sizeof(a.sin6_addr)) == 0;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Server

struct TcpStoreServer::State {
  TcpStoreLimits limits;
  std::string run_id;
  int world_size = 0;
  int listen_fd = -1;
  int port = 0;
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable changed;
  std::map<std::string, std::vector<char>> data;  // guarded by mu
  std::vector<int> clients;                       // guarded by mu
  std::vector<std::thread> handlers;              // guarded by mu
  std::thread acceptor;

  void Accept();
  void Serve(int fd);
  // The reply to one request; false ends the connection.
  bool Handle(int fd, const std::string& body, bool* introduced);
};

void TcpStoreServer::State::Accept() {
  while (!stop) {
    pollfd p{listen_fd, POLLIN, 0};
    constexpr int kStopCheckMs = 50;
    if (::poll(&p, 1, kStopCheckMs) <= 0) continue;
    const int fd = ::accept(listen_fd, nullptr, nullptr);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu);
    if (stop || static_cast<int>(clients.size()) >= limits.max_connections) {
      ::close(fd);
      continue;
    }
    clients.push_back(fd);
    handlers.emplace_back([this, fd] { Serve(fd); });
  }
}

void TcpStoreServer::State::Serve(int fd) {
  bool introduced = false;
  while (!stop) {
    StatusOr<std::string> body = ReadFrame(fd, MaxFrameBytes(limits), Clock::time_point::max());
    if (!body.ok() || !Handle(fd, *body, &introduced)) break;
  }
  ::shutdown(fd, SHUT_RDWR);
}

bool TcpStoreServer::State::Handle(int fd, const std::string& body, bool* introduced) {
  auto reply = [fd](Reply status, const std::string& field) {
    return WriteAll(fd, Frame(Body(status, {field}))).ok();
  };
  // A request the store cannot take is answered, then the connection ends.
  auto refuse = [&reply](const std::string& why) {
    reply(kFailed, why);
    return false;
  };
  StatusOr<std::vector<std::string>> fields = Fields(body);
  if (!fields.ok()) return refuse(fields.status().message());
  const uint8_t op = static_cast<uint8_t>(body[0]);
  const std::vector<std::string>& f = *fields;
  if (!*introduced) {
    if (op != kHello || f.size() != 2) return refuse("not a dc rendezvous client");
    const std::string world = std::to_string(world_size);
    if (f[0] != run_id || f[1] != world) {
      return refuse("this rendezvous serves run '" + run_id + "' of " + world +
                    " rank(s), not run '" + f[0] + "' of " + f[1]);
    }
    *introduced = true;
    return reply(kOk, "");
  }
  if (op == kSet && f.size() == 2 && static_cast<int64_t>(f[0].size()) <= limits.max_key_bytes &&
      static_cast<int64_t>(f[1].size()) <= limits.max_value_bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      data[f[0]] = std::vector<char>(f[1].begin(), f[1].end());
    }
    changed.notify_all();
    return reply(kOk, "");
  }
  if (op == kGet && f.size() == 1) {
    std::unique_lock<std::mutex> lock(mu);
    changed.wait(lock, [&] { return stop || data.count(f[0]) > 0; });
    if (stop) return false;
    const std::vector<char>& value = data[f[0]];
    const std::string copy(value.begin(), value.end());
    lock.unlock();
    return reply(kOk, copy);
  }
  return refuse("a malformed request");
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

TcpStoreServer::~TcpStoreServer() {
  state_->stop = true;
  state_->changed.notify_all();
  if (state_->acceptor.joinable()) state_->acceptor.join();
  std::vector<std::thread> handlers;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (int fd : state_->clients) ::shutdown(fd, SHUT_RDWR);
    handlers.swap(state_->handlers);
  }
  state_->changed.notify_all();
  for (std::thread& t : handlers) t.join();
  for (int fd : state_->clients) ::close(fd);
  ::close(state_->listen_fd);
}

int TcpStoreServer::port() const { return state_->port; }

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(int port, const std::string& run_id,
                                                                int world_size,
                                                                const TcpStoreLimits& limits) {
  auto state = std::make_unique<State>();
  state->limits = limits;
  state->run_id = run_id;
  state->world_size = world_size;
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool v6 = fd >= 0;
  const int listen_fd = v6 ? fd : ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd < 0) return Status::Error("socket: " + Errno());
  const int on = 1, off = 0;
  ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  int bound = -1;
  if (v6) {
    ::setsockopt(listen_fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));  // IPv4 too
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(static_cast<uint16_t>(port));
    bound = ::bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    bound = ::bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  constexpr int kBacklog = 1024;
  if (bound != 0 || ::listen(listen_fd, kBacklog) != 0) {
    const std::string why = Errno();
    ::close(listen_fd);
    return Status::Error("cannot serve the rendezvous on port " + std::to_string(port) + " (" +
                         why + ")");
  }
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&local), &length);
  state->port =
      ntohs(local.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&local)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  state->listen_fd = listen_fd;
  State* raw = state.get();
  state->acceptor = std::thread([raw] { raw->Accept(); });
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(state)));
}

// ---------------------------------------------------------------------------------------------
// Client

TcpStore::TcpStore(int fd, std::string where, TcpStoreLimits limits)
    : fd_(fd), where_(std::move(where)), limits_(limits) {}

TcpStore::~TcpStore() { ::close(fd_); }

StatusOr<std::unique_ptr<TcpStore>> TcpStore::Connect(const std::string& host, int port,
                                                      const std::string& run_id, int world_size,
                                                      std::chrono::milliseconds timeout,
                                                      const TcpStoreLimits& limits) {
  const std::string where = host + ":" + std::to_string(port);
  const auto deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last_error = "no address";
  constexpr auto kRetry = std::chrono::milliseconds(50);
  while (true) {
    addrinfo* found = nullptr;
    const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (resolved != 0) {
      last_error = std::string("cannot resolve ") + host + ": " + ::gai_strerror(resolved);
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        if (ConnectedToItself(fd)) {
          last_error = "connected to itself: nothing listens there yet";
          ::close(fd);
          continue;
        }
        ::freeaddrinfo(found);
        const int on = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
        std::unique_ptr<TcpStore> store(new TcpStore(fd, where, limits));
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::max(deadline - Clock::now(), Clock::duration(kRetry)));
        auto hello = store->Call(kHello, {run_id, std::to_string(world_size)}, left);
        if (!hello.ok()) return hello.status();
        return store;
      }
      last_error = Errno();
      ::close(fd);
    }
    if (found != nullptr) ::freeaddrinfo(found);
    if (Clock::now() + kRetry >= deadline) break;
    std::this_thread::sleep_for(kRetry);
  }
  return Status::Error("no rendezvous answered at " + where + " within " +
                       std::to_string(timeout.count() / 1000) + " s (" + last_error +
                       "); is rank 0 started, with the same MASTER_ADDR and MASTER_PORT?");
}

StatusOr<std::vector<char>> TcpStore::Call(uint8_t op, const std::vector<std::string>& fields,
                                           std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  Status sent = WriteAll(fd_, Frame(Body(op, fields)));
  if (!sent.ok()) return Status::Error("the rendezvous at " + where_ + ": " + sent.message());
  StatusOr<std::string> body = ReadFrame(fd_, MaxFrameBytes(limits_), deadline);
  if (!body.ok()) {
    return Status::Error("the rendezvous at " + where_ + ": " + body.status().message() +
                         (op == kHello ? " (is another program listening there?)" : ""));
  }
  StatusOr<std::vector<std::string>> reply = Fields(*body);
  const uint8_t status = static_cast<uint8_t>((*body)[0]);
  if (!reply.ok() || reply->size() != 1 || (status != kOk && status != kFailed)) {
    return Status::Error("the rendezvous at " + where_ +
                         " answered with a malformed reply (is another program listening there?)");
  }
  if (status == kFailed) return Status::Error("the rendezvous at " + where_ + ": " + (*reply)[0]);
  return std::vector<char>((*reply)[0].begin(), (*reply)[0].end());
}

Status TcpStore::Set(const std::string& key, const std::vector<char>& value) {
  constexpr auto kSetTimeout = std::chrono::milliseconds(60000);
  return Call(kSet, {key, std::string(value.begin(), value.end())}, kSetTimeout).status();
}

StatusOr<std::vector<char>> TcpStore::Get(const std::string& key,
                                          std::chrono::milliseconds timeout) {
  auto value = Call(kGet, {key}, timeout);
  if (!value.ok() && value.status().message().find("timed out") != std::string::npos) {
    return Status::Error("the rendezvous at " + where_ + ": no rank set '" + key + "' within " +
                         std::to_string(timeout.count() / 1000) + " s");
  }
  return value;
}

StatusOr<TcpRendezvous> TcpRendezvous::Join(const std::string& host, int port,
                                            const std::string& run_id, int world_size, int rank,
                                            std::chrono::milliseconds timeout) {
  const std::string who = "rank " + std::to_string(rank) + ": ";
  if (host.empty() || port <= 0) {
    return Status::Error(who +
                         "no rendezvous; set MASTER_ADDR and MASTER_PORT, or pass --rendezvous "
                         "a directory every rank can reach");
  }
  TcpRendezvous rendezvous;
  if (rank == 0) {
    auto server = TcpStoreServer::Start(port, run_id, world_size);
    if (!server.ok()) {
      return Status::Error(who + server.status().message() +
                           "; set MASTER_PORT (or DC_MASTER_PORT) to a free port");
    }
    rendezvous.server = std::move(*server);
  }
  auto store = TcpStore::Connect(host, port, run_id, world_size, timeout);
  if (!store.ok()) return store.status().Prefixed(who);
  rendezvous.store = std::move(*store);
  return rendezvous;
}

}  // namespace dc

// The TCP rendezvous store: values between clients, a GET that waits for its SET, the run's
// identity, time-outs, and a hostile peer that must not bring the server down.
#include "executor/tcp_store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

namespace dc {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kTimeout{5000};

std::unique_ptr<TcpStoreServer> Serve(const std::string& run = "run-a", int world = 2) {
  auto server = TcpStoreServer::Start(0, run, world);  // port 0: any free port
  EXPECT_TRUE(server.ok()) << server.status().message();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<TcpStore> Client(int port, const std::string& run = "run-a", int world = 2) {
  auto store = TcpStore::Connect("127.0.0.1", port, run, world, kTimeout);
  EXPECT_TRUE(store.ok()) << store.status().message();
  return store.ok() ? std::move(*store) : nullptr;
}

std::vector<char> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(TcpStore, ValuesPassBetweenClientsAndGetWaitsForSet) {
  auto server = Serve();
  ASSERT_TRUE(server);
  ASSERT_GT(server->port(), 0);
  auto a = Client(server->port());
  auto b = Client(server->port());
  ASSERT_TRUE(a && b);
  // b asks first; a sets later; b's GET returns the value once it is there.
  std::vector<char> got;
  std::thread reader([&] {
    auto value = b->Get("key", kTimeout);
    ASSERT_TRUE(value.ok()) << value.status().message();
    got = *value;
  });
  std::this_thread::sleep_for(milliseconds(100));
  std::string binary("a\0b\xff", 4);
  ASSERT_TRUE(a->Set("key", Bytes(binary)).ok());
  reader.join();
  EXPECT_EQ(got, Bytes(binary));
  // Empty values, and a key set again takes the new value.
  ASSERT_TRUE(a->Set("empty", {}).ok());
  auto empty = b->Get("empty", kTimeout);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  ASSERT_TRUE(b->Set("key", Bytes("second")).ok());
  EXPECT_EQ(*a->Get("key", kTimeout), Bytes("second"));
}

TEST(TcpStore, ClientsWaitForAServerThatStartsLater) {
  // Reserve a free port, free it, and start the server there after the client began trying.
  // Another process (a test beside this one binding an ephemeral port) can take the port in
  // those 300 ms: then the attempt says nothing about waiting, and the test tries another port.
  constexpr int kAttempts = 5;
  for (int attempt = 1; attempt <= kAttempts; ++attempt) {
    auto probe = Serve();
    ASSERT_TRUE(probe);
    const int port = probe->port();
    probe.reset();
    std::unique_ptr<TcpStoreServer> server;
    std::thread starter([&] {
      std::this_thread::sleep_for(milliseconds(300));
      auto started = TcpStoreServer::Start(port, "run-a", 2);
      if (started.ok()) server = std::move(*started);
    });
    auto store = TcpStore::Connect("localhost", port, "run-a", 2, kTimeout);
    starter.join();
    if (!server && attempt < kAttempts) continue;
    ASSERT_TRUE(server) << "port " << port << " was taken meanwhile, " << kAttempts << " times";
    ASSERT_TRUE(store.ok()) << store.status().message();
    EXPECT_TRUE((*store)->Set("k", Bytes("v")).ok());
    return;
  }
}

// A socket bound to port P that connects to 127.0.0.1:P, where nothing listens, is joined to
// itself (Linux's simultaneous open): what a retrying client can fall into by chance, here on
// purpose. A connection to a real server is not.
TEST(TcpStore, ASocketConnectedToItselfIsToldApart) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in self{};
  self.sin_family = AF_INET;
  self.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&self), sizeof(self)), 0);
  socklen_t size = sizeof(self);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &size), 0);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&self), sizeof(self)), 0)
      << "the kernel refused a simultaneous open";
  EXPECT_TRUE(ConnectedToItself(fd));
  ::close(fd);

  auto server = Serve();
  ASSERT_TRUE(server);
  const int client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(client, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<uint16_t>(server->port()));
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  EXPECT_FALSE(ConnectedToItself(client));
  ::close(client);
}

TEST(TcpStore, AnotherRunIsRefusedByName) {
  auto server = Serve("run-a", 2);
  ASSERT_TRUE(server);
  auto other = TcpStore::Connect("127.0.0.1", server->port(), "run-b", 2, kTimeout);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find(
                "this rendezvous serves run 'run-a' of 2 rank(s), not run 'run-b' of 2"),
            std::string::npos)
      << other.status().message();
  auto bigger = TcpStore::Connect("127.0.0.1", server->port(), "run-a", 4, kTimeout);
  ASSERT_FALSE(bigger.ok());
  EXPECT_NE(bigger.status().message().find("not run 'run-a' of 4"), std::string::npos);
}

TEST(TcpStore, TimeOutsNameTheKeyOrTheAddress) {
  auto server = Serve();
  ASSERT_TRUE(server);
  auto store = Client(server->port());
  ASSERT_TRUE(store);
  auto missing = store->Get("never-set", milliseconds(200));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no rank set 'never-set' within"), std::string::npos)
      << missing.status().message();

  const int port = server->port();
  server.reset();
  auto nobody = TcpStore::Connect("127.0.0.1", port, "run-a", 2, milliseconds(300));
  ASSERT_FALSE(nobody.ok());
  EXPECT_NE(
      nobody.status().message().find("no rendezvous answered at 127.0.0.1:" + std::to_string(port)),
      std::string::npos)
      << nobody.status().message();
}

TEST(TcpStore, APortInUseIsRefused) {
  auto server = Serve();
  ASSERT_TRUE(server);
  auto second = TcpStoreServer::Start(server->port(), "run-a", 2);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot serve the rendezvous on port " +
                                           std::to_string(server->port())),
            std::string::npos)
      << second.status().message();
}

// Raw bytes at the server: garbage, a huge length, a half message. Each connection is dropped
// and the server goes on serving well-behaved clients.
TEST(TcpStore, HostilePeersDoNotStopTheServer) {
  auto server = Serve();
  ASSERT_TRUE(server);
  auto raw = [&](const std::string& bytes) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    ::close(fd);
  };
  raw("GET / HTTP/1.1\r\n\r\n");
  raw(std::string("\xff\xff\xff\x7f", 4));                      // a 2 GiB message
  raw(std::string("\x10\x00\x00\x00\x02", 5));                  // cut off
  raw(std::string("\x05\x00\x00\x00\x02\xff\xff\xff\xff", 9));  // a field past its message
  auto a = Client(server->port());
  auto b = Client(server->port());
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->Set("still", Bytes("serving")).ok());
  EXPECT_EQ(*b->Get("still", kTimeout), Bytes("serving"));
}

// A server destroyed while a client waits in GET: the client's call ends with an error, not a
// hang, and the destructor returns.
TEST(TcpStore, StoppingTheServerEndsWaitingCalls) {
  auto server = Serve();
  ASSERT_TRUE(server);
  auto store = Client(server->port());
  ASSERT_TRUE(store);
  std::thread stopper([&] {
    std::this_thread::sleep_for(milliseconds(200));
    server.reset();
  });
  auto value = store->Get("never", kTimeout);
  stopper.join();
  EXPECT_FALSE(value.ok());
}

}  // namespace
}  // namespace dc

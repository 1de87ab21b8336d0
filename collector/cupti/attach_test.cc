// libdc_inject.so and `dc-collect --attach` without a GPU: the library loads and exports only
// InitializeInjection; RunAttached fails with one line where there is nothing to trace and
// merges the files of stand-in processes (dc_fake_traced_process) where there is.
#include "collector/cupti/attach.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "analyzer/trace.h"

namespace dc {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dc_attach_test_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string File(const std::string& name) const { return (fs::path(path_) / name).string(); }
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

int64_t QueryInt(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
  int64_t value = -1;
  if (stmt && sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return value;
}

std::string QueryText(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
  std::string value = "<no row>";
  if (stmt && sqlite3_step(stmt) == SQLITE_ROW) {
    const unsigned char* text = sqlite3_column_text(stmt, 0);
    value = text ? reinterpret_cast<const char*>(text) : "<null>";
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return value;
}

AttachOptions Options(const TempDir& dir) {
  AttachOptions options;
  options.output_path = dir.File("trace.db");
  options.inject_library = DC_INJECT_LIBRARY;
  options.quiet = true;
  return options;
}

// Runs RunAttached and returns its status and what it printed on stderr.
std::pair<int, std::string> RunTraced(const AttachOptions& options,
                                      const std::vector<std::string>& command) {
  testing::internal::CaptureStderr();
  const int status = RunAttached(options, command);
  return {status, testing::internal::GetCapturedStderr()};
}

TEST(InjectLibrary, LoadsAndExportsOnlyInitializeInjection) {
  void* lib = dlopen(DC_INJECT_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using Init = int (*)();
  auto init = reinterpret_cast<Init>(dlsym(lib, "InitializeInjection"));
  ASSERT_NE(init, nullptr) << dlerror();
  // The collector's own symbols stay inside: they must not clash with the traced program's.
  EXPECT_EQ(dlsym(lib, "_ZN2dc22IsAnotherProfilerErrorERKNS_6StatusE"), nullptr);
  EXPECT_EQ(
      dlsym(lib, "_ZN2dc14TempPathBesideERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"),
      nullptr);

  // Without DC_TRACE_OUTPUT it says why in one line and leaves the program untraced.
  const char* saved = std::getenv("DC_TRACE_OUTPUT");
  const std::string saved_value = saved ? saved : "";
  unsetenv("DC_TRACE_OUTPUT");
  testing::internal::CaptureStderr();
  EXPECT_EQ(init(), 1);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err,
            "dc: DC_TRACE_OUTPUT is not set (start the program with dc-collect --attach); "
            "running untraced\n");
  if (saved) setenv("DC_TRACE_OUTPUT", saved_value.c_str(), 1);
  // Not dlclosed: the library registers nothing, but unloading it is never done by CUDA either.
}

TEST(RunAttached, FailsWhenTheProgramProducesNoTrace) {
  TempDir dir;
  auto [status, err] = RunTraced(Options(dir), {"/bin/true"});
  EXPECT_EQ(status, 1);
  EXPECT_EQ(err,
            "dc-collect: '/bin/true' produced no trace (it never initialized CUDA, or it exited "
            "without running exit handlers (os._exit, a signal); the program exited with "
            "status 0)\n");
  EXPECT_TRUE(dir.Entries().empty());  // no output, no temp directory
}

TEST(RunAttached, FailsWithoutTheInjectionLibrary) {
  TempDir dir;
  AttachOptions options = Options(dir);
  options.inject_library = dir.File("libdc_inject.so");
  auto [status, err] = RunTraced(options, {"/bin/true"});
  EXPECT_EQ(status, 1);
  EXPECT_EQ(err, "dc-collect: " + dir.File("libdc_inject.so") +
                     ": no such file; libdc_inject.so is needed to trace an unmodified program\n");
  // Looked up beside the test binary (collector/cupti/) and in its ../lib: not there.
  StatusOr<std::string> found = FindInjectLibrary();
  ASSERT_FALSE(found.ok());
  EXPECT_NE(found.status().message().find("libdc_inject.so not found in "), std::string::npos);
}

TEST(RunAttached, FailsWhenTheCommandCannotStart) {
  TempDir dir;
  auto [status, err] = RunTraced(Options(dir), {dir.File("no-such-program")});
  EXPECT_EQ(status, 1);
  EXPECT_EQ(err, "dc-collect: cannot start '" + dir.File("no-such-program") +
                     "': No such file or directory\n");
  auto [empty_status, empty_err] = RunTraced(Options(dir), {});
  EXPECT_EQ(empty_status, 1);
  EXPECT_NE(empty_err.find("--attach needs the program to run after --"), std::string::npos);
  EXPECT_TRUE(dir.Entries().empty());
}

TEST(RunAttached, MergesEveryTracedProcessAndNumbersTheRanks) {
  TempDir dir;
  const std::string fake = DC_FAKE_TRACED_PROCESS;
  // Two processes without RANK, one with it, one that never used CUDA.
  auto [status, err] =
      RunTraced(Options(dir), {"/bin/sh", "-c",
                               fake + " write & " + fake + " write & RANK=1 WORLD_SIZE=3 " + fake +
                                   " write & " + fake + " none & wait"});
  ASSERT_EQ(status, 0) << err;
  const std::string out = dir.File("trace.db");
  ASSERT_TRUE(fs::exists(out)) << err;
  EXPECT_EQ(dir.Entries(), std::vector<std::string>{"trace.db"});
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM TC_RANK"), 3);
  EXPECT_EQ(QueryText(out,
                      "SELECT group_concat(rank, ',') FROM (SELECT rank FROM TC_RANK "
                      "ORDER BY rank)"),
            "0,1,2");
  EXPECT_EQ(QueryInt(out, "SELECT min(worldSize) FROM TC_RANK"), 3);
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 6);
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM TC_COLLECTIVE"), 3);
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM TC_BLOB"), 0);
  EXPECT_EQ(QueryText(out, "SELECT value FROM META_DATA_EXPORT WHERE name = 'dc.capture'"),
            "attach");
  EXPECT_EQ(QueryText(out, "SELECT value FROM META_DATA_EXPORT WHERE name = 'dc.world_size'"), "3");
  EXPECT_EQ(QueryText(out,
                      "SELECT value FROM META_DATA_CAPTURE WHERE name = 'dc.command' "
                      "LIMIT 1"),
            "/bin/sh -c " + fake + " write & " + fake + " write & RANK=1 WORLD_SIZE=3 " + fake +
                " write & " + fake + " none & wait");
  // One session origin for every process, set by RunAttached: the kernels' starts are small.
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM TARGET_INFO_SESSION_START_TIME"), 1);
  EXPECT_GT(QueryInt(out, "SELECT min(start) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 0);
  EXPECT_LT(QueryInt(out, "SELECT max(start) FROM CUPTI_ACTIVITY_KIND_KERNEL"),
            int64_t{60} * 1'000'000'000);
}

TEST(RunAttached, PassesThroughTheExitStatusAndEmbedsOurSchedule) {
  TempDir dir;
  proto::Schedule schedule;
  schedule.set_world_size(1);
  schedule.set_backend("cuda");
  AttachOptions options = Options(dir);
  options.schedule = &schedule;
  auto [status, err] = RunTraced(options, {DC_FAKE_TRACED_PROCESS, "write", "3"});
  EXPECT_EQ(status, 3) << err;
  // Our own program: the schedule is embedded and the analyzer reads the trace.
  auto trace = Trace::Open(options.output_path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  EXPECT_EQ((*trace)->ranks().size(), 1u);
  int activities = 0;
  ASSERT_TRUE((*trace)->ForEachActivity([&](const Activity&) { ++activities; }).ok());
  EXPECT_EQ(activities, 3);  // a kernel, a collective, a memcpy
}

}  // namespace
}  // namespace dc

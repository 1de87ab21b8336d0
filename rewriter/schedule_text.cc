#include "rewriter/schedule_text.h"

#include <charconv>
#include <map>
#include <sstream>

namespace dc {

namespace {

constexpr proto::InstrKind kKinds[] = {proto::INSTR_COMPUTE, proto::INSTR_ALL_GATHER,
                                       proto::INSTR_RELEASE, proto::INSTR_REDUCE_SCATTER,
                                       proto::INSTR_OFFLOAD, proto::INSTR_RELOAD,
                                       proto::INSTR_RENAME,  proto::INSTR_ALL_REDUCE};
constexpr proto::Stream kStreams[] = {proto::STREAM_COMPUTE, proto::STREAM_GATHER,
                                      proto::STREAM_REDUCE,  proto::STREAM_H2D,
                                      proto::STREAM_D2H,     proto::STREAM_HOST};

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, sep)) {
    part = Trim(part);
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// The whole of `text` as an int; false for anything else (not a number, trailing characters, out
// of int's range): the text comes from people and files, so no exception.
bool ParseInt(const std::string& text, int* value) {
  const char* end = text.data() + text.size();
  const auto [at, error] = std::from_chars(text.data(), end, *value);
  return error == std::errc() && at == end;
}

}  // namespace

std::string ScheduleToText(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  std::ostringstream out;
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const auto& instr = schedule.instructions(i);
    out << i << ": " << InstrKindName(instr.kind()) << " " << StreamName(instr.stream()) << " ";
    if (instr.micro_step() < 0) {
      out << "opt";
    } else {
      out << "m" << instr.micro_step();
    }
    if (instr.kind() == proto::INSTR_COMPUTE) {
      out << " " << program.ops(instr.op()).name();
    } else {
      if (instr.kind() == proto::INSTR_RENAME) out << " " << program.ops(instr.op()).name();
      out << " [";
      for (int k = 0; k < instr.tensors_size(); ++k) {
        out << (k ? ", " : "") << program.tensors(instr.tensors(k)).name();
      }
      out << "]";
    }
    if (instr.deps_size() > 0) {
      out << " deps=";
      for (int k = 0; k < instr.deps_size(); ++k) out << (k ? "," : "") << instr.deps(k);
    }
    if (instr.bucket() > 0) out << " bucket=" << instr.bucket();
    out << "\n";
  }
  return out.str();
}

Status ParseScheduleText(const std::string& text, proto::Schedule* schedule) {
  const proto::Program& program = schedule->program();
  std::map<std::string, int> ops, tensors;
  for (const auto& op : program.ops()) ops[op.name()] = op.id();
  for (const auto& t : program.tensors()) tensors[t.name()] = t.id();
  std::map<std::string, proto::InstrKind> kinds;
  for (auto k : kKinds) kinds[InstrKindName(k)] = k;
  std::map<std::string, proto::Stream> streams;
  for (auto s : kStreams) streams[StreamName(s)] = s;

  google::protobuf::RepeatedPtrField<proto::Instruction> parsed;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    line = Trim(line);
    if (line.empty()) continue;
    auto fail = [&](const std::string& why) {
      return Status::Error("schedule text line " + std::to_string(line_no) + ": " + why + ": '" +
                           line + "'");
    };
    std::string rest = line;
    if (auto colon = rest.find(':'); colon != std::string::npos && rest.find('[') > colon) {
      const std::string index = Trim(rest.substr(0, colon));
      if (index != std::to_string(parsed.size()))
        return fail("index " + index + " is not the position");
      rest = Trim(rest.substr(colon + 1));
    }
    // Pull out a bracketed tensor list first; names have no spaces.
    std::vector<std::string> tensor_names;
    if (auto open = rest.find('['); open != std::string::npos) {
      const auto close = rest.find(']', open);
      if (close == std::string::npos) return fail("unclosed [");
      tensor_names = Split(rest.substr(open + 1, close - open - 1), ',');
      rest = rest.substr(0, open) + " " + rest.substr(close + 1);
    }
    std::vector<std::string> words = Split(rest, ' ');
    if (words.size() < 3) return fail("expected: kind stream micro-step ...");
    proto::Instruction instr;
    if (!kinds.count(words[0])) return fail("unknown kind " + words[0]);
    if (!streams.count(words[1])) return fail("unknown stream " + words[1]);
    instr.set_kind(kinds[words[0]]);
    instr.set_stream(streams[words[1]]);
    instr.set_op(-1);
    if (words[2] == "opt") {
      instr.set_micro_step(-1);
    } else if (int micro = 0;
               words[2].size() > 1 && words[2][0] == 'm' && ParseInt(words[2].substr(1), &micro)) {
      instr.set_micro_step(micro);
    } else {
      return fail("bad micro-step " + words[2]);
    }
    for (size_t w = 3; w < words.size(); ++w) {
      const std::string& word = words[w];
      int number = 0;
      if (word.rfind("deps=", 0) == 0) {
        for (const auto& d : Split(word.substr(5), ',')) {
          if (!ParseInt(d, &number)) return fail("bad dependency " + d);
          instr.add_deps(number);
        }
      } else if (word.rfind("bucket=", 0) == 0) {
        if (!ParseInt(word.substr(7), &number)) return fail("bad bucket " + word.substr(7));
        instr.set_bucket(number);
      } else if ((instr.kind() == proto::INSTR_COMPUTE || instr.kind() == proto::INSTR_RENAME) &&
                 instr.op() < 0) {
        if (!ops.count(word)) return fail("unknown op " + word);
        instr.set_op(ops[word]);
      } else {
        return fail("unexpected " + word);
      }
    }
    if ((instr.kind() == proto::INSTR_COMPUTE || instr.kind() == proto::INSTR_RENAME) &&
        instr.op() < 0) {
      return fail(std::string(InstrKindName(instr.kind())) + " without an op");
    }
    for (const auto& name : tensor_names) {
      if (!tensors.count(name)) return fail("unknown tensor " + name);
      instr.add_tensors(tensors[name]);
    }
    *parsed.Add() = std::move(instr);
  }
  schedule->mutable_instructions()->Swap(&parsed);
  return Status::Ok();
}

}  // namespace dc

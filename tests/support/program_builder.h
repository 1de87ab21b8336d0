// Hand-built programs for unit tests: a tensor or an op at a time, ids in order.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "schemas/program.h"

namespace dc::test {

// Adds a 1-D tensor of `elements` with the next id. `param`: the param a grad or optimizer
// state belongs to (-1: none).
inline void AddTensor(proto::Program* program, const std::string& name, int64_t elements,
                      proto::Role role, proto::DType dtype = proto::DTYPE_F32, int param = -1) {
  proto::Tensor* t = program->add_tensors();
  t->set_id(program->tensors_size() - 1);
  t->set_name(name);
  t->add_shape(elements);
  t->set_dtype(dtype);
  t->set_role(role);
  t->set_param(param);
}

// Adds an op with the next id.
inline void AddOp(proto::Program* program, const std::string& name, proto::Phase phase,
                  std::initializer_list<int> inputs, std::initializer_list<int> outputs) {
  proto::Op* op = program->add_ops();
  op->set_id(program->ops_size() - 1);
  op->set_name(name);
  op->set_phase(phase);
  for (int t : inputs) op->add_inputs(t);
  for (int t : outputs) op->add_outputs(t);
}

}  // namespace dc::test

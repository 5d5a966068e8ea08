// GIL release for blocking calls that is safe at interpreter exit.
//
// pybind11's gil_scoped_release re-takes the GIL in its destructor, which is implicitly
// noexcept. If the interpreter is finalizing by then (a daemon thread still blocked in
// recv or wait_imm when the main thread returns), CPython < 3.14 ends that thread with
// pthread_exit from inside PyEval_RestoreThread; the forced unwind meets the noexcept
// destructor and std::terminate aborts the whole process ("terminate called without an
// active exception") after a clean shutdown. Here the destructor may throw, so the forced
// unwind runs through it and pybind11's dispatcher (which rethrows abi::__forced_unwind)
// and the thread ends quietly, as a pure-Python thread does. Only when an exception is
// already in flight could a second unwind not start: then the thread parks until the
// process exits (what CPython 3.14 does with every such thread).
#pragma once

#include <Python.h>

#include <chrono>
#include <exception>
#include <thread>

namespace kvxfer {

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() noexcept(false) {
    if (std::uncaught_exceptions() > 0) {
      while (interpreter_finalizing()) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

}  // namespace kvxfer

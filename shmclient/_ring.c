/* The ring's per-message path: see the module docstring below (RING_DOC). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>

#include "_spin_gate.h"

PyDoc_STRVAR(RING_DOC,
"Per-message path of shmclient's SPSC ring: write + publish, see + read + release, the\n"
"bounded spin and the futex sleep/wake. Lowest layer; ``shmclient.ring`` is its only user\n"
"and owns everything else (segment life cycle, slice loop with the liveness check,\n"
"timeouts, errors, statistics). No Python object is kept here but the caller's buffer.\n"
"\n"
"Layout (all offsets from the start of the mapping; every group on its own 64-byte line):\n"
"  0   magic, version, capacity                      (written once by the creator)\n"
"  64  head: bytes published (u64)                    producer stores, release\n"
"  128 producer statistics (records, bytes, batches, wraps, fragments, waits_full)\n"
"  192 p_closed (u32)\n"
"  256 tail: bytes released (u64)                     consumer stores, release\n"
"  320 consumer statistics (records, bytes, batches, spins, blocks)\n"
"  384 c_closed (u32)\n"
"  448 c_wait (u32: 1 = asleep on data_seq, 2 = wants a byte on the wake pipe), data_seq\n"
"  512 p_wait (u32: 1 = asleep on space_seq, 2 = wants a byte on the space pipe),\n"
"      space_seq (u32)\n"
"  576 producer spins, blocks (statistics)\n"
"  4096 data: capacity bytes of records\n"
"A record is an 8-byte header (u32 payload length, u8 type, u8 flags, 2 spare bytes)\n"
"and the payload padded to 8 bytes. PAD covers the rest of the ring when a record does\n"
"not fit before the end; MORE / CONT mark the pieces of a message longer than one\n"
"record, the first prefixed with the u64 total length.\n"
"\n"
"Memory ordering (C11 atomics; what each compiles to on x86-64 and aarch64):\n"
"* Positions are the authority. head and tail are byte counts that only grow. The\n"
"  producer writes record bytes with plain stores, then stores head with release order\n"
"  (x86-64: a plain MOV, since x86-TSO never reorders a store with an earlier store;\n"
"  aarch64: STLR, which orders every earlier load and store before it). The consumer\n"
"  loads head with acquire order (x86-64: MOV, loads are not reordered with later loads;\n"
"  aarch64: LDAR, no later load or store is performed before it) and reads only bytes\n"
"  below it: they are the bytes stored before the release that wrote that head value.\n"
"  A producer killed mid-write never stored the head that covers its partial record, so\n"
"  no partial record is ever read.\n"
"* The consumer stores tail with release order after its last read of the bytes below\n"
"  it; the producer loads tail with acquire order before it writes into the space below\n"
"  tail + capacity. Release orders earlier loads too (aarch64 STLR), so the producer can\n"
"  never overwrite a byte the consumer is still reading. Free space is tail + capacity -\n"
"  write position: nothing is reclaimed lazily and no token is counted. A record whose\n"
"  view a receive handler kept is released when the view's last export goes: in the\n"
"  thread that drops it, under the GIL, after every read through it (the GIL orders\n"
"  another thread's reads before it), with the same release store. Its exporter (the\n"
"  view's obj) refuses a new export from then on, so no read through it comes later.\n"
"* Taking a batch is one call: load head, read every record below it, store tail. No\n"
"  Python bytecode runs between seeing data and recording that it was read, so no\n"
"  exception (KeyboardInterrupt) can split them.\n"
"* Sleeping without lost wake-ups is Dekker's pattern with two full fences. A waiter\n"
"  reads the futex word (seq), stores its wait flag, issues a seq_cst fence (x86-64:\n"
"  MFENCE or a locked instruction; aarch64: DMB ISH), re-loads the position and sleeps\n"
"  with FUTEX_WAIT(seq) only if it has not moved. The other side stores the position,\n"
"  issues a seq_cst fence, then loads the flag; if it is set it clears it, bumps the\n"
"  futex word and calls FUTEX_WAKE. Two SC fences forbid both loads from reading the old\n"
"  values (the store-buffering litmus test), so either the waiter sees the new position\n"
"  or the poster sees the flag. If the poster bumps the word before the waiter enters\n"
"  the kernel, FUTEX_WAIT finds the word changed and returns at once (EAGAIN); if after,\n"
"  the waiter is queued and FUTEX_WAKE finds it. The futex words are shared (no\n"
"  FUTEX_PRIVATE_FLAG): the mapping is MAP_SHARED between processes.\n"
"* Several threads of one end may sleep at once: the poster wakes them all (INT_MAX),\n"
"  each woken one sets the flag again before it re-checks, and a thread leaving its wait\n"
"  clears the flag only when it is the last sleeper of its end (a count under the GIL),\n"
"  so one leaving never takes the flag from another still asleep. A flag left set costs\n"
"  the poster one spare FUTEX_WAKE, never a lost wake-up.\n"
"* What a waiter re-checks must turn true at every move of the peer after the attempt\n"
"  that failed, whatever else this side loads meanwhile. The consumer's condition is a\n"
"  state: head differs from its read position. The producer's is a change: tail differs\n"
"  from the tail its last failed reservation loaded, a copy only a failed reservation\n"
"  writes (pending(), a write that fits and the waiters' own checks never do), so one\n"
"  release wakes every waiter and one that came before the wait (while a WouldBlock\n"
"  message was made, say) is seen by the first check. Another thread's later failed\n"
"  reservation replaces the copy with the tail it loaded (it found no room even after\n"
"  that release). A wait after no failed reservation may return at once: the retry\n"
"  fails (and records the tail) or goes through; a spurious wake-up, never a lost one.\n"
"* Whether a waiter spins before it sleeps is the spin gate's call (_spin_gate.h): it\n"
"  changes only how long the waiter polls, never the order of the stores and fences\n"
"  above.\n"
"* The poster's common case is one fence and one relaxed load of the flag: no system\n"
"  call unless the peer sleeps. A consumer with a wake pipe (for an event loop) sets flag\n"
"  2 after every read, fences and re-checks head (writing the byte itself if a record\n"
"  slipped in); the poster writes one byte to the pipe per flag it clears. So the pipe\n"
"  is readable whenever a published record has not been read.\n"
"* A producer with a space pipe (an event-loop task waiting for room) does the mirror\n"
"  image: arm_space() sets flag 2 on p_wait and fences, then the caller retries its\n"
"  write, which loads tail; the consumer stores tail, fences, loads the flag and writes\n"
"  the byte when it clears flag 2. Either the retry sees the new tail or the byte comes.\n"
"* close() stores the closed flag (seq_cst), then bumps both futex words, wakes every\n"
"  waiter and writes the pipe. A consumer loads the peer's closed flag before head, so\n"
"  it always reads what was published before the close first.\n"
"* Timeouts are relative and measured on CLOCK_MONOTONIC (FUTEX_WAIT's relative timeout\n"
"  is), so a wall-clock step never stretches a wait. EINTR returns to Python at once:\n"
"  the wait calls PyErr_CheckSignals, and a handler's exception propagates. The GIL is\n"
"  released only while the thread sleeps in the kernel; the spin holds it.\n"
"* A wait does not make its end busy: its readiness checks run under the GIL and touch\n"
"  at most the head cache the consumer's other calls refresh too (the producer's check\n"
"  stores nothing), so another thread of this side may send or receive while one sleeps.\n"
"  The mapping stays until the last waiter left.\n"
"* A producer may defer the wake-up (``quiet``): it stores head as always, skips the\n"
"  fence and the flag, and owes a wake-up; ``wake_owed()`` later issues the same fence\n"
"  and flag check, as does any later publish that is not quiet (also one with nothing\n"
"  new: a send that did not fit). A consumer that went to sleep meanwhile sleeps until then (or until\n"
"  its timeout), and one that looks finds the records: the deferral delays a wake-up,\n"
"  it cannot lose one, as long as the owed call comes (its caller's promise).\n"
"* Statistics are relaxed atomics written by one side: hints, never decisions.\n"
"\n"
"The peer is not trusted (it may be broken, or not shmclient):\n"
"* Every value it writes into the mapping (head or tail, a record header, a fragmented\n"
"  message's total, and at attach the capacity) is loaded once into a local by an atomic\n"
"  load (so the compiler cannot load it again), checked, and only the copy is used:\n"
"  positions are multiples of 8 and tail <= head <= tail + capacity; head never moves back\n"
"  nor more than the capacity past the tail this side released; tail never moves back nor\n"
"  past what was written; a record or PAD fits below head and before the ring's end; a\n"
"  total is at most MAX_MESSAGE, what send_part accepts. A violation closes this end (the\n"
"  peer sees it closed) and raises RingCorruptError (a ProtocolError) naming the field,\n"
"  its value and the bound; every later call raises it again. A record costs the two\n"
"  compares it always did (a PAD one more) and a batch a few more, and no ordering above\n"
"  changes: every load of record bytes still follows the acquire load of the head that\n"
"  covers them.\n"
"* Calls of one end: a call makes its end busy, remembering its thread. A call from that\n"
"  thread (a receive handler using its own ring) is refused with RuntimeError. Another\n"
"  thread's lock-free fast-path call declines (the caller takes its slow path); a slow\n"
"  path, which holds the Python lock, waits without the GIL on a process-private futex\n"
"  word that the busy call bumps as it leaves (and close() bumps too).\n"
"* Fork: an end made before fork() is the parent's. A pthread_atfork hook bumps a\n"
"  generation in the child; every entry point compares it (one compare) and raises\n"
"  ForkedError, so a child never writes, reads, releases or closes its parent's ring.\n"
"  A receive handler or a signal handler inside a wait that forked compares it again\n"
"  when it returns, before touching the mapping. forget() drops the child's copy of the\n"
"  mapping without a store to it (a call of the forking thread, or a record view the\n"
"  child holds, keeps it until it ends).\n"
"* An end whose __init__ did not complete (made with __new__, or its __init__ raised)\n"
"  has no mapping. Its generation is 0, which no process's is, so the same compare\n"
"  refuses every call with ValueError; the getters check it too. __init__ runs once: a\n"
"  second one is refused (the first's mapping may be in use).\n");

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record header is read as one little-endian u64"
#endif

#define MAGIC 0x32474E4952434D53ULL /* "SMCRING2" */
#define VERSION 2
#define HEADER_BYTES 4096
#define REC_HDR 8
#define MAX_MESSAGE 0xFFFFFFFFULL /* the longest message (fragmented), both ends */

#define F_PAD 0x02
#define F_MORE 0x04
#define F_CONT 0x08

#define OFF_MAGIC 0
#define OFF_VERSION 8
#define OFF_CAPACITY 16
#define OFF_HEAD 64
#define OFF_P_RECORDS 128
#define OFF_P_BYTES 136
#define OFF_P_BATCHES 144
#define OFF_WRAPS 152
#define OFF_FRAGMENTS 160
#define OFF_WAITS_FULL 168
#define OFF_P_CLOSED 192
#define OFF_TAIL 256
#define OFF_C_RECORDS 320
#define OFF_C_BYTES 328
#define OFF_C_BATCHES 336
#define OFF_C_SPINS 344
#define OFF_C_BLOCKS 352
#define OFF_C_CLOSED 384
#define OFF_C_WAIT 448
#define OFF_DATA_SEQ 452
#define OFF_P_WAIT 512
#define OFF_SPACE_SEQ 516
#define OFF_P_SPINS 576
#define OFF_P_BLOCKS 584

#define U64(base, off) ((_Atomic uint64_t *)((base) + (off)))
#define U32(base, off) ((_Atomic uint32_t *)((base) + (off)))

/* a timeout longer than this waits without a deadline (no timespec can overflow) */
#define FOREVER_S 1e9

/* wait results */
#define W_READY 0   /* data (or space) came while spinning */
#define W_WOKEN 1   /* came after sleeping */
#define W_TIMEOUT 2 /* nothing within the timeout */
#define W_CLOSED 3  /* the peer closed and nothing more is there */
#define W_SLEPT 4   /* came after sleeping without a spin first (spin 0, or the gate's veto) */

static PyObject *CorruptError; /* shmclient.errors.RingCorruptError (a ProtocolError) */
static PyObject *ForkedError;  /* shmclient.errors.ForkedError */
static PyObject *ClosedError;  /* shmclient.errors.ClientClosedError (an EngineDeadError) */

/* Bumped in every child made by fork(): an end made before the fork is the parent's.
   It starts at 1: generation 0 is an end whose __init__ has not completed. */
static unsigned long fork_gen = 1;
static void in_forked_child(void) { fork_gen++; }

#if PY_VERSION_HEX < 0x030C0000
static PyObject *get_raised(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t) return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb && v) PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}
static void set_raised(PyObject *v) {
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(v)), v, PyException_GetTraceback(v));
}
#else
#define get_raised PyErr_GetRaisedException
#define set_raised PyErr_SetRaisedException
#endif

static inline uint64_t ld_acq(char *b, size_t off) { return atomic_load_explicit(U64(b, off), memory_order_acquire); }
/* One load of a peer-writable word: the value is bounds-checked once and only that
   copy is used (a plain read could be repeated by the compiler). */
static inline uint64_t ld_once(const char *p) {
    return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_relaxed);
}
static inline void st_rel(char *b, size_t off, uint64_t v) { atomic_store_explicit(U64(b, off), v, memory_order_release); }
static inline void stat_add(char *b, size_t off, uint64_t v) {
    /* single writer: load + store, no read-modify-write needed */
    _Atomic uint64_t *p = U64(b, off);
    atomic_store_explicit(p, atomic_load_explicit(p, memory_order_relaxed) + v, memory_order_relaxed);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* Sleep while *addr == val, at most `timeout` seconds (FOREVER_S or more: no limit). */
static long futex_wait(_Atomic uint32_t *addr, uint32_t val, double timeout) {
    struct timespec ts;
    if (!(timeout < FOREVER_S))
        return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, NULL, NULL, 0);
    if (timeout < 0) timeout = 0;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec < 0) ts.tv_nsec = 0;
    if (ts.tv_nsec > 999999999L) ts.tv_nsec = 999999999L;
    return syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* After moving a position: wake the peer if it announced it sleeps (see RING_DOC). */
static inline void notify(char *b, size_t flag_off, size_t seq_off, int pipe_fd) {
    atomic_thread_fence(memory_order_seq_cst);
    _Atomic uint32_t *flag = U32(b, flag_off);
    if (atomic_load_explicit(flag, memory_order_relaxed) == 0) return;
    uint32_t w = atomic_exchange_explicit(flag, 0, memory_order_seq_cst);
    if (w & 1) {
        atomic_fetch_add_explicit(U32(b, seq_off), 1, memory_order_seq_cst);
        futex_wake(U32(b, seq_off));
    }
    if ((w & 2) && pipe_fd >= 0) {
        char c = 1;
        ssize_t r = write(pipe_fd, &c, 1); /* a full pipe already means "wake" */
        (void)r;
    }
}

/* ------------------------------------------------------------------ common end */

typedef struct {
    PyObject_HEAD
    Py_buffer buf;      /* the whole mapping; keeps it alive */
    char *base;
    char *data;
    uint64_t cap;
    int pipe_fd;        /* producer: write end of the consumer's wake pipe, or -1 */
    int busy;           /* a call of this end is running (re-entry from a handler) */
    int closed;
    int detach_pending; /* detach() came while a call was running (from its handler) */
    Py_ssize_t views;   /* record views alive: the mapping stays until the last is gone */
    Py_ssize_t waiters; /* threads inside a wait (they do not make the end busy: a wait
                           touches no read or write state outside the GIL, so another
                           thread may send or receive meanwhile); the mapping stays until
                           the last has left */
    Py_ssize_t sleepers; /* threads of this end past their spin, with the sleep flag set:
                            the last to leave clears it (one leaving must not take it from
                            another still asleep: its poster would then not wake it) */
    int held;           /* a Python-level slow path of this end is running (see ring.py):
                           fast-path calls (mine=False) then decline and take the lock */
    PyThreadState *busy_ts; /* the thread whose call made the end busy */
    int idle_waiters;   /* threads waiting for that call to end (end_wait_idle) */
    _Atomic uint32_t idle_seq; /* process-private futex word: bumped when busy clears */
    unsigned long gen;  /* fork_gen when made: another value means a forked child; 0
                           until __init__ completes (set last, see end_made) */
    pid_t pid;          /* the process that made this end (for the error message) */
    const char *role;
    PyObject *broken;   /* the message of the protocol violation that closed the end */
    PyObject *on_drop;  /* called once a mapping detach() or forget() left in place is
                           dropped (the owner then unmaps it) */
} End;

static int end_init_buffer(End *self, PyObject *mapping) {
    if (PyObject_GetBuffer(mapping, &self->buf, PyBUF_WRITABLE) < 0) return -1;
    if (self->buf.len < HEADER_BYTES + 64) {
        PyErr_SetString(PyExc_ValueError, "mapping is smaller than a ring header");
        return -1;
    }
    self->base = (char *)self->buf.buf;
    if (((uintptr_t)self->base) & 63) {
        PyErr_SetString(PyExc_ValueError, "mapping is not 64-byte aligned");
        return -1;
    }
    /* each header word is read once; only the copies are checked and used */
    uint64_t magic = atomic_load_explicit(U64(self->base, OFF_MAGIC), memory_order_acquire);
    uint64_t ver = ld_once(self->base + OFF_VERSION);
    uint64_t cap = ld_once(self->base + OFF_CAPACITY);
    if (magic != MAGIC || ver != VERSION) {
        PyErr_SetString(PyExc_ValueError, "mapping does not hold a ring of this version");
        return -1;
    }
    uint64_t room = (uint64_t)self->buf.len - HEADER_BYTES; /* > 64: checked above */
    if (cap < 64 || cap % 8 || cap > room) {
        PyErr_Format(PyExc_ValueError, "capacity = %llu in the ring header is not a multiple of 8 "
                     "from 64 to %llu (the mapping's data bytes)", (unsigned long long)cap,
                     (unsigned long long)room);
        return -1;
    }
    self->cap = cap;
    self->pid = getpid();
    self->data = self->base + HEADER_BYTES;
    return 0;
}

static void end_drop_buffer(End *self) {
    if (self->buf.obj) PyBuffer_Release(&self->buf);
    self->base = self->data = NULL;
}

/* The last call, view or waiter that kept a detached (or forgotten) end's mapping has
   gone: drop it and tell the owner (on_drop), keeping any exception being raised. */
static void end_drop_late(End *self) {
    self->detach_pending = 0;
    end_drop_buffer(self);
    PyObject *cb = self->on_drop;
    self->on_drop = NULL;
    if (cb) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallNoArgs(cb);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable(cb);
        PyErr_Restore(et, ev, tb);
        Py_DECREF(cb);
    }
}

/* Every call that entered with end_enter leaves through here. */
static inline void end_leave(End *self) {
    self->busy = 0;
    if (self->idle_waiters) { /* another thread waits for this call to end */
        atomic_fetch_add_explicit(&self->idle_seq, 1, memory_order_relaxed);
        syscall(SYS_futex, (uint32_t *)&self->idle_seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    if (self->detach_pending && self->views == 0 && self->waiters == 0) end_drop_late(self);
}

static void end_dealloc(End *self) {
    Py_CLEAR(self->broken);
    Py_CLEAR(self->on_drop);
    if (self->buf.obj) PyBuffer_Release(&self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An end whose __init__ has not completed (made with __new__, or its __init__ raised):
   no mapping, nothing to read or write. */
__attribute__((cold, noinline)) static int end_unmade(End *self) {
    PyErr_Format(PyExc_ValueError, "this %s is not initialised (its __init__ did not run, "
                 "or raised)", Py_TYPE(self)->tp_name);
    return -1;
}

/* For calls that do not check for a fork (the getters): -1 with ValueError if __init__
   has not completed, else 0. */
static inline int end_made(End *self) { return self->gen ? 0 : end_unmade(self); }

/* __init__ once: a second one would swap the mapping and the positions under the
   waits and views still using the first. */
static int end_init_once(End *self) {
    if (!self->gen) return 0;
    PyErr_Format(PyExc_RuntimeError, "this %s is initialised already", Py_TYPE(self)->tp_name);
    return -1;
}

static PyObject *end_get_held(End *self, void *c) {
    if (end_made(self) < 0) return NULL;
    return PyBool_FromLong(self->held);
}

static int end_set_held(End *self, PyObject *v, void *c) {
    if (end_made(self) < 0) return -1;
    int b = v ? PyObject_IsTrue(v) : 0;
    if (b < 0) return -1;
    self->held = b;
    return 0;
}

/* Use in a forked child, or before __init__ completed: -1 with ForkedError (the end is
   the parent's) or ValueError (end_unmade), else 0. */
__attribute__((cold, noinline)) static int end_forked(End *self) {
    if (self->gen == fork_gen) return 0;
    if (!self->gen) return end_unmade(self);
    PyErr_Format(ForkedError, "this %s end of the ring belongs to process %d; the forked "
                 "child %d cannot use it (nothing was written or read): make a new client in "
                 "the child", self->role, (int)self->pid, (int)getpid());
    return -1;
}

/* The error of a closed end: the protocol violation that closed it, if one did. */
__attribute__((cold, noinline)) static int end_closed_error(End *self) {
    if (self->broken) PyErr_SetObject(CorruptError, self->broken);
    else PyErr_Format(ClosedError, "this %s end of the ring was closed", self->role);
    return -1;
}

/* Checks of a call that reads this end's state without entering it: forked, closed,
   re-entry from this thread's handler. */
static int end_check(End *self) {
    if (end_forked(self) < 0) return -1;
    if (self->closed) return end_closed_error(self);
    if (self->busy && self->busy_ts == PyThreadState_Get()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "re-entrant use of a ring end (a receive handler must not use its own ring)");
        return -1;
    }
    return 0;
}

/* Wait, without the GIL, until the call that makes this end busy ends (or the end is
   closed: close() wakes us). -1 if a signal handler raised. */
static int end_wait_idle(End *self) {
    uint32_t s = atomic_load_explicit(&self->idle_seq, memory_order_relaxed);
    long rc;
    int err;
    self->idle_waiters++;
    Py_BEGIN_ALLOW_THREADS
    /* the busy thread bumps the word under the GIL, so either it did before we read it
       (then busy is 0 already) or after we let go of the GIL (then the wait returns) */
    rc = syscall(SYS_futex, (uint32_t *)&self->idle_seq, FUTEX_WAIT_PRIVATE, s, NULL, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (self->idle_waiters > 0) self->idle_waiters--; /* (forget() zeroed it in a child
                                                          forked by a signal handler) */
    if (rc == -1 && err == EINTR && PyErr_CheckSignals() < 0) return -1;
    return 0;
}

#define E_FAST 0 /* a lock-free fast path: declines while held, closed or busy */
#define E_MINE 1 /* the caller holds the Python lock: waits for another thread's call */
#define E_SKIP 2 /* declines only while another thread's call runs */

/* A receive's `mine` argument: false E_FAST, true E_MINE, 2 E_SKIP (the caller holds the
   lock but must not wait: recv_into with timeout 0). */
static int mine_mode(PyObject *o) {
    if (PyLong_CheckExact(o) && PyLong_AsLong(o) == 2) return E_SKIP;
    int b = PyObject_IsTrue(o);
    return b > 0 ? E_MINE : b == 0 ? E_FAST : -1;
}

static int end_enter_slow(End *self, int mode);

/* Enter a call: 0 entered (busy), 1 declined (see the modes above), -1 error. A call
   from the thread whose call made the end busy (a receive handler) is refused. The
   common case (not busy, not closed, not held, not forked) is one test here. */
static inline int end_enter(End *self, int mode) {
    if (__builtin_expect(!(self->busy | self->closed | (mode == E_FAST && self->held)) &&
                         self->gen == fork_gen, 1)) {
        self->busy = 1;
        self->busy_ts = PyThreadState_Get();
        return 0;
    }
    return end_enter_slow(self, mode);
}

__attribute__((noinline)) static int end_enter_slow(End *self, int mode) {
    if (self->gen != fork_gen) return end_forked(self);
    PyThreadState *me = PyThreadState_Get();
    /* re-entry first: a handler sent to the slow path would wait for the lock of a
       thread that itself waits for the handler's call to end */
    if (self->busy && self->busy_ts == me) {
        PyErr_SetString(PyExc_RuntimeError,
                        "re-entrant use of a ring end (a receive handler must not use its own ring)");
        return -1;
    }
    if (mode == E_FAST && (self->held || self->closed)) return 1;
    for (;;) {
        if (self->closed) return end_closed_error(self);
        if (!self->busy) break;
        if (mode != E_MINE) return 1;
        if (end_wait_idle(self) < 0) return -1;
        if (self->gen != fork_gen) return end_forked(self);
    }
    self->busy = 1;
    self->busy_ts = me;
    return 0;
}

/* A protocol violation by the peer: close this end (the peer sees it closed), remember
   why, and raise RingCorruptError naming the field, its value and the bound. */
static PyObject *end_close_common(End *e, size_t my_flag);
static PyObject *consumer_close_impl(End *e);

__attribute__((cold, noinline)) static int violation(End *e, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    PyObject *what = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (!what) return -1;
    PyObject *msg = PyUnicode_FromFormat("ring protocol violation seen by the %s: %U; this %s "
                                         "end is closed", e->role, what, e->role);
    Py_DECREF(what);
    if (!msg) return -1;
    if (!e->closed) {
        PyObject *r = e->role[0] == 'c' ? consumer_close_impl(e) : end_close_common(e, OFF_P_CLOSED);
        Py_XDECREF(r);
        PyErr_Clear();
    }
    Py_XSETREF(e->broken, msg);
    PyErr_SetObject(CorruptError, msg);
    return -1;
}

/* Spin up to `spin` seconds (if the spin gate allows it: see _spin_gate.h), then sleep
   on the futex, until ready(self) or the timeout (FOREVER_S or more: none). Returns W_* or
   -1 with an exception set (a signal handler raised). */
typedef int (*ready_fn)(End *);

static Gate the_gate; /* the process's spin gate (GIL-protected) */

static inline int w_result(int r, int slept) { return r == 2 ? W_CLOSED : (slept ? W_WOKEN : W_READY); }

/* The spin and the timeout are separate bounds: the spin may outlast the timeout (a spin
   with timeout 0 is a pure spin), and a spin the gate vetoes is not turned into a sleep
   of its length: the sleep ends at the caller's timeout. */
static int wait_common(End *self, ready_fn ready, size_t flag_off, size_t seq_off,
                       double spin, double timeout) {
    double t0 = now_s();
    double deadline = t0 + (timeout < 0 ? 0 : timeout);
    int r = ready(self);
    if (r) return w_result(r, 0);
    int spun = 0;
    if (spin > 0 && gate_spin_ok(&the_gate, t0)) {
        double end = t0 + spin;
        double prev = t0, now;
        spun = 1;
        int preempted = 0;
        long switched = involuntary_switches();
        do {
            for (int k = 0; k < 32; k++) {
                cpu_relax();
                r = ready(self);
                if (r) {
                    gate_clean(&the_gate);
                    return w_result(r, 0);
                }
            }
            now = now_s();
            /* Our clock reads are ~1 us apart while we hold the CPU: a longer gap is
               time we did not run. If the kernel switched us out for another thread
               meanwhile (an involuntary switch), the spin costs someone a CPU; else the
               time went to the hypervisor (steal) or an interrupt, which the spin did not
               cause and a sleep would not avoid. */
            if (now - prev > GATE_PREEMPT_S) {
                long sw = involuntary_switches();
                if (gate_gap(&the_gate, now, now - prev, sw != switched)) {
                    preempted = 1;
                    break;
                }
                switched = sw; /* (mode "always" spins on: the next gap is judged alone) */
            }
            prev = now;
        } while (now < end);
        if (!preempted) gate_clean(&the_gate);
    }
    _Atomic uint32_t *flag = U32(self->base, flag_off);
    _Atomic uint32_t *seq = U32(self->base, seq_off);
    self->sleepers++;
    for (;;) {
        uint32_t s = atomic_load_explicit(seq, memory_order_acquire);
        atomic_fetch_or_explicit(flag, 1, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        r = ready(self);
        if (r) break;
        if (self->closed) { /* this side was closed by another thread: the caller sees it */
            r = -2;
            break;
        }
        double left = deadline - now_s();
        if (left <= 0) {
            r = -2;
            break;
        }
        long rc;
        int err;
        Py_BEGIN_ALLOW_THREADS
        rc = futex_wait(seq, s, left);
        err = errno;
        Py_END_ALLOW_THREADS
        if (rc == -1 && err == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                r = -1;
                break;
            }
            /* the handler forked and this is the child: the mapping is the parent's, and
               forget() may have dropped it; touch nothing of it */
            if (self->gen != fork_gen) return end_forked(self);
        }
        /* EAGAIN (the word moved), ETIMEDOUT, EINTR or a wake: re-check at the top */
    }
    if (--self->sleepers == 0) atomic_fetch_and_explicit(flag, ~1u, memory_order_relaxed);
    if (r == -1) return -1;
    if (r == -2) return W_TIMEOUT;
    if (r == 2) return W_CLOSED;
    return spun ? W_WOKEN : W_SLEPT;
}

/* The body of both ends' wait methods: (spin_s, timeout_s[, first]) -> W_*; statistics
   at the given header offsets (counted_off: once per wait, on its first slice; 0: none). */
static PyObject *end_wait_method(End *e, PyObject *args, ready_fn ready, size_t flag_off,
                                 size_t seq_off, size_t spins_off, size_t blocks_off,
                                 size_t counted_off) {
    double spin, timeout;
    int first = 1;
    if (!PyArg_ParseTuple(args, "dd|p", &spin, &timeout, &first)) return NULL;
    if (!(spin >= 0) || !(timeout >= 0) || isinf(spin)) {
        PyErr_Format(PyExc_ValueError,
                     "a wait needs a spin and a timeout >= 0 seconds (inf: no timeout), "
                     "got spin %R, timeout %R", PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(args, 1));
        return NULL;
    }
    if (e->closed || !e->base) {
        PyErr_Format(ClosedError, "this %s end of the ring was closed", e->role);
        return NULL;
    }
    if (e->busy && e->busy_ts == PyThreadState_Get()) {
        /* a receive handler waiting on its own ring: the space it could wait for is
           released only when its call returns (a full ring never gets room) */
        PyErr_SetString(PyExc_RuntimeError,
                        "re-entrant use of a ring end (a receive handler must not use its own ring)");
        return NULL;
    }
    e->waiters++;
    if (first && counted_off) stat_add(e->base, counted_off, 1);
    int r = wait_common(e, ready, flag_off, seq_off, spin, timeout);
    if (e->gen != fork_gen) return NULL; /* forked by a signal handler: see wait_common */
    if (r == W_READY) stat_add(e->base, spins_off, 1);
    else if (r == W_WOKEN || r == W_SLEPT) stat_add(e->base, blocks_off, 1);
    if (--e->waiters == 0 && e->detach_pending && !e->busy && e->views == 0) end_drop_late(e);
    if (r < 0) return NULL;
    return PyLong_FromLong(r);
}

/* ------------------------------------------------------------------ producer */

typedef struct {
    End e;
    uint64_t wpos;      /* bytes written (published or not) */
    uint64_t tail;      /* last tail seen */
    uint64_t full_tail; /* the tail the last failed reservation saw: wait_space waits for
                           tail to move from it (only p_reserve writes it) */
    uint64_t published; /* last head stored */
    uint64_t pend_records, pend_bytes;
    int quiet;          /* publish without waking the consumer (the wake is owed) */
    int owed;           /* a quiet publish has not been followed by a wake-up yet */
} Producer;

static inline uint64_t p_free(Producer *p) {
    return p->tail + p->e.cap - p->wpos;
}

/* Whether a tail the consumer stored breaks the protocol: it only grows, never past
   what was written, and stays a multiple of 8 (records and PADs are). */
static inline int p_tail_bad(Producer *p, uint64_t t) {
    return (t - p->tail > p->wpos - p->tail) | (int)(t & 7);
}

__attribute__((cold, noinline)) static int p_bad_tail(Producer *p, uint64_t t) {
    return violation(&p->e, "tail = %llu is not a multiple of 8 or outside [%llu, %llu] (the "
                     "last tail seen, the write position)", (unsigned long long)t,
                     (unsigned long long)p->tail, (unsigned long long)p->wpos);
}

/* Load tail once; -1 (the end closed, RingCorruptError raised) if it breaks the protocol. */
static int p_load_tail(Producer *p) {
    uint64_t t = ld_acq(p->e.base, OFF_TAIL);
    if (p_tail_bad(p, t)) return p_bad_tail(p, t);
    p->tail = t;
    return 0;
}

/* Reserve `size` contiguous bytes, writing a PAD to the end of the ring if needed.
   Returns the offset, -1 if there is no room now, -2 with RingCorruptError raised (the
   consumer stored a tail that breaks the protocol; the end is closed). */
static int64_t p_reserve(Producer *p, uint64_t size) {
    uint64_t cap = p->e.cap;
    for (;;) {
        uint64_t pos = p->wpos % cap;
        uint64_t room = cap - pos;
        uint64_t need = size <= room ? size : room; /* the record, or first the pad */
        if (need > p_free(p)) {
            if (p_load_tail(p) < 0) return -2;
            if (need > p_free(p)) {
                p->full_tail = p->tail; /* what a release must move (p_space_ready) */
                return -1;
            }
        }
        if (size <= room) return (int64_t)pos;
        /* pad to the end (space the consumer frees once it has read it), then retry at 0 */
        char *h = p->e.data + pos;
        uint32_t zero = 0;
        memcpy(h, &zero, 4);
        h[4] = 0;
        h[5] = F_PAD;
        h[6] = h[7] = 0;
        p->wpos += room;
        stat_add(p->e.base, OFF_WRAPS, 1);
    }
}

static inline void p_write(Producer *p, uint64_t pos, uint32_t len, uint8_t type, uint8_t flags,
                           const void *pre, size_t prelen, const void *src, size_t n) {
    char *h = p->e.data + pos;
    memcpy(h, &len, 4);
    h[4] = (char)type;
    h[5] = (char)flags;
    h[6] = h[7] = 0;
    if (prelen) memcpy(h + REC_HDR, pre, prelen);
    if (n) memcpy(h + REC_HDR + prelen, src, n);
    uint64_t size = ((uint64_t)len + 15) & ~7ULL;
    p->wpos += size;
    if (pos + size == p->e.cap) stat_add(p->e.base, OFF_WRAPS, 1); /* ends exactly at the end */
}

static void p_publish(Producer *p) {
    if (p->wpos == p->published) {
        /* Nothing new (a send that did not fit): a waking call still gives the wake-up
           that quiet publishes owe, else a consumer could sleep on a full ring of records
           it has not seen while the producer waits for room. */
        if (p->owed && !p->quiet) {
            p->owed = 0;
            notify(p->e.base, OFF_C_WAIT, OFF_DATA_SEQ, p->e.pipe_fd);
        }
        return;
    }
    char *b = p->e.base;
    stat_add(b, OFF_P_RECORDS, p->pend_records);
    stat_add(b, OFF_P_BYTES, p->pend_bytes);
    stat_add(b, OFF_P_BATCHES, 1);
    p->pend_records = p->pend_bytes = 0;
    p->published = p->wpos;
    st_rel(b, OFF_HEAD, p->wpos);
    if (p->quiet) {
        p->owed = 1;
        return;
    }
    p->owed = 0;
    notify(b, OFF_C_WAIT, OFF_DATA_SEQ, p->e.pipe_fd);
}

static int parse_type(PyObject *o, uint8_t *t) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto bad;
    }
    if (v < 0 || v > 255 || PyBool_Check(o)) goto bad;
    *t = (uint8_t)v;
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "record type must be an int in 0..255, got %R", o);
    return -1;
}

/* At attach: head and tail multiples of 8, tail <= head <= tail + capacity. A
   misaligned position would make a record header (or a PAD) cross the ring's end. */
static int check_positions(End *e, uint64_t head, uint64_t tail) {
    const char *why = NULL;
    if (tail & 7) why = "tail is not a multiple of 8";
    else if (head & 7) why = "head is not a multiple of 8";
    else if (head - tail > e->cap) why = "head is not within [tail, tail + capacity]";
    if (!why) return 0;
    PyErr_Format(CorruptError, "ring protocol violation seen by the attaching %s: head = %llu, "
                 "tail = %llu, capacity = %llu: %s", e->role, (unsigned long long)head,
                 (unsigned long long)tail, (unsigned long long)e->cap, why);
    return -1;
}

static uint64_t max_record(Producer *p) {
    /* the largest payload written as one record: the whole ring less its header (a
       record that must wrap pads to the end first, then waits for the whole ring) */
    uint64_t m = p->e.cap - REC_HDR;
    return m > 0xFFFFFFF8ULL ? 0xFFFFFFF8ULL : m;
}

static int producer_init(Producer *self, PyObject *args, PyObject *kw) {
    PyObject *mapping;
    int fd = -1;
    static char *kwlist[] = {"mapping", "pipe_fd", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|i", kwlist, &mapping, &fd)) return -1;
    if (end_init_once(&self->e) < 0) return -1;
    self->e.role = "producer";
    if (end_init_buffer(&self->e, mapping) < 0) goto fail;
    self->e.pipe_fd = fd;
    /* a producer attaches to a ring that may already carry data (never in shmclient,
       but stay consistent): start from the published head */
    uint64_t head = ld_acq(self->e.base, OFF_HEAD), tail = ld_acq(self->e.base, OFF_TAIL);
    if (check_positions(&self->e, head, tail) < 0) goto fail;
    self->wpos = self->published = head;
    self->tail = self->full_tail = tail;
    self->e.gen = fork_gen; /* last: the end is usable */
    return 0;
fail: /* not initialised: every call refuses it (a later __init__ may still succeed) */
    end_drop_buffer(&self->e);
    return -1;
}

/* append(type, payload) -> bool: write one record without publishing; False if it does
   not fit now. ValueError if it is larger than max_record (send it with send_part). */
static PyObject *producer_append_impl(Producer *self, PyObject *const *args, Py_ssize_t nargs, int publish) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "expected (type, payload[, mine])");
        return NULL;
    }
    int entered = end_enter(&self->e, nargs == 3 ? E_MINE : E_FAST);
    if (entered) { /* declined: take the slow path */
        if (entered < 0) return NULL;
        Py_RETURN_FALSE;
    }
    uint8_t t;
    Py_buffer pl;
    PyObject *res = NULL;
    if (parse_type(args[0], &t) < 0) goto out;
    if (PyObject_GetBuffer(args[1], &pl, PyBUF_SIMPLE) < 0) goto out;
    if (atomic_load_explicit(U32(self->e.base, OFF_C_CLOSED), memory_order_acquire)) {
        res = Py_NewRef(Py_None); /* None: the consumer has closed */
        goto release;
    }
    if ((uint64_t)pl.len > max_record(self)) {
        PyErr_Format(PyExc_OverflowError, "payload of %zd bytes needs fragments", pl.len);
        goto release;
    }
    uint64_t size = ((uint64_t)pl.len + 15) & ~7ULL;
    int64_t pos = p_reserve(self, size);
    if (pos < 0) {
        if (pos == -1) {
            if (publish) p_publish(self);
            res = Py_NewRef(Py_False);
        }
        goto release;
    }
    p_write(self, (uint64_t)pos, (uint32_t)pl.len, t, 0, NULL, 0, pl.buf, (size_t)pl.len);
    self->pend_records++;
    self->pend_bytes += (uint64_t)pl.len;
    if (publish) p_publish(self);
    res = Py_NewRef(Py_True);
release:
    PyBuffer_Release(&pl);
out:
    end_leave(&self->e);
    return res;
}

static PyObject *producer_append(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    return producer_append_impl(self, args, nargs, 0);
}

static PyObject *producer_try_send(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    return producer_append_impl(self, args, nargs, 1);
}

static PyObject *producer_publish(Producer *self, PyObject *unused) {
    if (end_enter(&self->e, E_MINE) < 0) return NULL;
    p_publish(self);
    end_leave(&self->e);
    Py_RETURN_NONE;
}

/* send_part(type, payload, offset, chunk) -> new offset: write the pieces of a message
   longer than one record, from `offset`, as far as space allows, publishing each piece.
   offset 0 starts a message; returns len(payload) when it is complete. None if the
   consumer has closed. */
static PyObject *producer_send_part(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "expected (type, payload, offset, chunk)");
        return NULL;
    }
    uint8_t t;
    if (parse_type(args[0], &t) < 0) return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(args[2]);
    Py_ssize_t chunk = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer pl;
    if (PyObject_GetBuffer(args[1], &pl, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *res = NULL;
    if (end_enter(&self->e, E_MINE) < 0) goto done;
    if (off < 0 || off > pl.len || chunk < 8 || (uint64_t)chunk + 8 > max_record(self)) {
        PyErr_SetString(PyExc_ValueError, "bad offset or chunk");
        goto out;
    }
    if ((uint64_t)pl.len > MAX_MESSAGE) { /* the consumer refuses a longer total */
        PyErr_Format(PyExc_OverflowError, "payload of %zd bytes is longer than a message can "
                     "be (%llu bytes)", pl.len, MAX_MESSAGE);
        goto out;
    }
    if (atomic_load_explicit(U32(self->e.base, OFF_C_CLOSED), memory_order_acquire)) {
        res = Py_NewRef(Py_None);
        goto out;
    }
    p_publish(self); /* anything appended before goes first */
    while (off < pl.len) {
        Py_ssize_t take = pl.len - off < chunk ? pl.len - off : chunk;
        int first = off == 0;
        uint64_t plen = (uint64_t)take + (first ? 8 : 0);
        int64_t pos = p_reserve(self, (plen + 15) & ~7ULL);
        if (pos == -2) goto out;
        if (pos < 0) break;
        uint8_t flags = (first ? 0 : F_CONT) | (off + take < pl.len ? F_MORE : 0);
        uint64_t total = (uint64_t)pl.len;
        p_write(self, (uint64_t)pos, (uint32_t)plen, t, flags, first ? &total : NULL, first ? 8 : 0,
                (char *)pl.buf + off, (size_t)take);
        off += take;
        stat_add(self->e.base, OFF_FRAGMENTS, 1);
        if (off == pl.len) {
            self->pend_records++;
            self->pend_bytes += (uint64_t)pl.len;
        }
        p_publish(self);
    }
    p_publish(self); /* a wrap pad written before running out of room */
    res = PyLong_FromSsize_t(off);
out:
    end_leave(&self->e);
done:
    PyBuffer_Release(&pl);
    return res;
}

/* Space was released since the last failed reservation: tail differs from the value
   that reservation loaded. Nothing is stored: what another call or another waiter loads
   meanwhile (pending(), a write, this check in another thread) cannot make a release
   that came after the failure look old. A tail that breaks the protocol reads as ready:
   the retried write loads it and says so. */
static int p_space_ready(End *e) {
    Producer *p = (Producer *)e;
    if (atomic_load_explicit(U32(e->base, OFF_C_CLOSED), memory_order_acquire)) return 2;
    return ld_acq(e->base, OFF_TAIL) != p->full_tail;
}

/* wait_space(spin_s, timeout_s) -> W_*: until the consumer releases space (tail moves
   past what the last failed write saw), the consumer closed, or the timeout. */
static PyObject *producer_wait_space(Producer *self, PyObject *args) {
    if (end_forked(&self->e) < 0) return NULL;
    if (self->e.broken) return (end_closed_error(&self->e), NULL);
    return end_wait_method(&self->e, args, p_space_ready, OFF_P_WAIT, OFF_SPACE_SEQ, OFF_P_SPINS,
                           OFF_P_BLOCKS, OFF_WAITS_FULL);
}

/* arm_space(): ask the consumer for a byte on the space pipe at its next release (flag 2
   on p_wait, then a full fence). The caller then retries its write: either the retry sees
   the released space or the consumer sees the flag (see RING_DOC). */
static PyObject *producer_arm_space(Producer *self, PyObject *unused) {
    if (end_forked(&self->e) < 0) return NULL;
    if (!self->e.base) Py_RETURN_NONE;
    atomic_fetch_or_explicit(U32(self->e.base, OFF_P_WAIT), 2, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyObject *producer_pending(Producer *self, PyObject *unused) {
    if (end_enter(&self->e, E_MINE) < 0) return NULL;
    /* bytes written but not yet released by the consumer; the tail is loaded into a
       local, so a query leaves the write path's state as it was */
    uint64_t t = ld_acq(self->e.base, OFF_TAIL);
    int bad = p_tail_bad(self, t) ? p_bad_tail(self, t) : 0;
    end_leave(&self->e);
    if (bad) return NULL;
    return PyLong_FromUnsignedLongLong(self->wpos - t);
}

static PyObject *end_close_common(End *e, size_t my_flag) {
    if (e->closed) Py_RETURN_NONE;
    e->closed = 1;
    if (e->idle_waiters) { /* a thread waiting for a call of this side to end sees it */
        atomic_fetch_add_explicit(&e->idle_seq, 1, memory_order_relaxed);
        syscall(SYS_futex, (uint32_t *)&e->idle_seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    char *b = e->base;
    atomic_store_explicit(U32(b, my_flag), 1, memory_order_seq_cst);
    atomic_fetch_add_explicit(U32(b, OFF_DATA_SEQ), 1, memory_order_seq_cst);
    atomic_fetch_add_explicit(U32(b, OFF_SPACE_SEQ), 1, memory_order_seq_cst);
    futex_wake(U32(b, OFF_DATA_SEQ));
    futex_wake(U32(b, OFF_SPACE_SEQ));
    if (e->pipe_fd >= 0) {
        char c = 1;
        ssize_t r = write(e->pipe_fd, &c, 1);
        (void)r;
    }
    Py_RETURN_NONE;
}

/* Keep the mapping until the last call, view or waiter has gone, then call on_drop. */
static int end_drop_later(End *self, PyObject *on_drop) {
    if (on_drop && on_drop != Py_None && !PyCallable_Check(on_drop)) {
        PyErr_SetString(PyExc_TypeError, "on_drop must be callable or None");
        return -1;
    }
    self->detach_pending = 1;
    Py_XSETREF(self->on_drop, on_drop && on_drop != Py_None ? Py_NewRef(on_drop) : NULL);
    return 0;
}

/* detach([on_drop]): drop the mapping (after close()). From inside a handler, with views
   still alive or a thread asleep in a wait, the running call, the last view or the last
   waiter drops it, then calls on_drop() (the owner unmaps: its unmap failed meanwhile). */
static PyObject *end_detach(End *self, PyObject *args) {
    PyObject *on_drop = NULL;
    if (!PyArg_ParseTuple(args, "|O:detach", &on_drop)) return NULL;
    if (end_forked(self) < 0) return NULL;
    if (!self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "detach() before close()");
        return NULL;
    }
    if (!self->base) Py_RETURN_NONE;
    if (self->busy || self->views || self->waiters) {
        if (end_drop_later(self, on_drop) < 0) return NULL;
    } else {
        end_drop_buffer(self);
    }
    Py_RETURN_NONE;
}

/* forget([on_drop]): in a forked child, let go of the parent's mapping without writing a
   byte of it (no closed flag, no wake-up: the ring is the parent's). The parent's other
   threads are not in this process: their waits and calls are forgotten; a call of this
   thread (a handler that forked) or a record view still alive here keeps the mapping
   until it ends, then on_drop() is called, as for detach(). */
static PyObject *end_forget(End *self, PyObject *args) {
    PyObject *on_drop = NULL;
    if (!PyArg_ParseTuple(args, "|O:forget", &on_drop)) return NULL;
    if (!self->gen || self->gen == fork_gen) {
        PyErr_SetString(PyExc_RuntimeError, "forget() is for an end a forked child inherited");
        return NULL;
    }
    self->closed = 1;
    self->waiters = self->sleepers = 0;
    self->idle_waiters = 0;
    if (self->busy && self->busy_ts != PyThreadState_Get()) self->busy = 0;
    if (!self->base) Py_RETURN_NONE;
    if (self->busy || self->views) {
        if (end_drop_later(self, on_drop) < 0) return NULL;
    } else {
        end_drop_buffer(self);
    }
    Py_RETURN_NONE;
}

/* wake_owed() -> whether a wake-up was owed: give the consumer the wake-up that quiet
   publishes held back (the fence and flag check of notify). */
static PyObject *producer_wake_owed(Producer *self, PyObject *unused) {
    if (self->e.closed) Py_RETURN_FALSE; /* close() woke every waiter */
    if (end_enter(&self->e, E_MINE) < 0) return NULL;
    int owed = self->owed;
    if (owed) {
        self->owed = 0;
        notify(self->e.base, OFF_C_WAIT, OFF_DATA_SEQ, self->e.pipe_fd);
    }
    end_leave(&self->e);
    return PyBool_FromLong(owed);
}

static PyObject *producer_get_quiet(Producer *self, void *c) {
    if (end_made(&self->e) < 0) return NULL;
    return PyBool_FromLong(self->quiet);
}

static int producer_set_quiet(Producer *self, PyObject *v, void *c) {
    if (end_made(&self->e) < 0) return -1;
    int b = v ? PyObject_IsTrue(v) : 0;
    if (b < 0) return -1;
    self->quiet = b;
    return 0;
}

static PyObject *producer_close(Producer *self, PyObject *unused) {
    if (end_forked(&self->e) < 0) return NULL;
    self->quiet = 0; /* close wakes every waiter anyway */
    if (!self->e.closed) p_publish(self);
    return end_close_common(&self->e, OFF_P_CLOSED);
}

static PyObject *producer_get_max_record(Producer *self, void *c) {
    if (end_made(&self->e) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(max_record(self));
}

static PyObject *end_get_capacity(End *self, void *c) {
    if (end_made(self) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(self->cap);
}

static PyMethodDef producer_methods[] = {
    {"try_send", (PyCFunction)(void (*)(void))producer_try_send, METH_FASTCALL,
     "try_send(type, payload) -> True (written and published), False (no room now; "
     "anything appended before is published), None (the consumer closed)."},
    {"append", (PyCFunction)(void (*)(void))producer_append, METH_FASTCALL,
     "append(type, payload) -> like try_send but not published; call publish()."},
    {"publish", (PyCFunction)producer_publish, METH_NOARGS, "Publish what was appended."},
    {"wake_owed", (PyCFunction)producer_wake_owed, METH_NOARGS,
     "wake_owed() -> bool: wake the consumer if a publish while quiet held its wake-up back."},
    {"send_part", (PyCFunction)(void (*)(void))producer_send_part, METH_FASTCALL,
     "send_part(type, payload, offset, chunk) -> new offset (None: consumer closed)."},
    {"wait_space", (PyCFunction)producer_wait_space, METH_VARARGS,
     "wait_space(spin_s, timeout_s) -> 0 space after spinning, 1 after spinning and "
     "sleeping, 2 timed out, 3 consumer closed, 4 after sleeping without a spin (spin 0 or "
     "the spin gate's veto). The spin may outlast the timeout; a vetoed spin never does. Releases the GIL only while asleep; a signal "
     "handler's exception propagates."},
    {"pending", (PyCFunction)producer_pending, METH_NOARGS, "Bytes not yet released."},
    {"arm_space", (PyCFunction)producer_arm_space, METH_NOARGS,
     "Ask the consumer for a byte on the space pipe at its next release; then retry the "
     "write (a lost wake-up is impossible: see the module docstring)."},
    {"close", (PyCFunction)producer_close, METH_NOARGS,
     "Publish, mark this side closed and wake every waiter. Idempotent."},
    {"detach", (PyCFunction)end_detach, METH_VARARGS,
     "detach(on_drop=None): drop the mapping (after close); while a call, view or waiter "
     "still uses it, the last of them drops it and calls on_drop()."},
    {"forget", (PyCFunction)end_forget, METH_VARARGS,
     "forget(on_drop=None): in a forked child, drop the parent's mapping without writing to "
     "it (while this thread's call or a view uses it, later, then on_drop())."},
    {NULL}};

static PyObject *producer_get_peer_closed(Producer *self, void *c) {
    if (end_forked(&self->e) < 0) return NULL;
    if (!self->e.base) Py_RETURN_FALSE;
    return PyBool_FromLong(atomic_load_explicit(U32(self->e.base, OFF_C_CLOSED), memory_order_acquire));
}

static PyGetSetDef producer_getset[] = {
    {"peer_closed", (getter)producer_get_peer_closed, NULL, "the consumer has closed", NULL},
    {"max_record", (getter)producer_get_max_record, NULL, "largest payload of one record", NULL},
    {"capacity", (getter)end_get_capacity, NULL, "the capacity this end read (once) and uses", NULL},
    {"held", (getter)end_get_held, (setter)end_set_held, "a slow path holds this end", NULL},
    {"quiet", (getter)producer_get_quiet, (setter)producer_set_quiet,
     "publishes store head but owe the consumer's wake-up (see wake_owed)", NULL},
    {NULL}};

static PyTypeObject ProducerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmclient._ring.Producer",
    .tp_basicsize = sizeof(Producer),
    .tp_dealloc = (destructor)end_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Producer(mapping, pipe_fd=-1): the writing end over a mapped ring.",
    .tp_methods = producer_methods,
    .tp_getset = producer_getset,
    .tp_init = (initproc)producer_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ record views */

/* The exporter behind every view a receive handler gets: it counts the buffer exports
   made from it. A memoryview and everything numpy or torch derives from it share one
   managed buffer, which holds one export until the last of them is gone; so
   exports == 0 after the handler's view is released means nobody reads these bytes.
   From then on (and once the end is closed) the exporter itself is released: ptr NULL,
   and a new export of it (a handler that kept view.obj) raises ValueError, rather than
   reading space the producer has reused since. */
typedef struct {
    PyObject_HEAD
    char *ptr;       /* NULL once released */
    Py_ssize_t len;
    Py_ssize_t exports;
    PyObject *owner; /* the consumer end: keeps the mapping alive while a view lives */
    int done;        /* the receive call that made it has returned from its handler */
} RecView;

static int recview_getbuffer(RecView *self, Py_buffer *view, int flags) {
    if (!self->ptr) {
        PyErr_SetString(PyExc_ValueError,
                        "record released: a received record's bytes are valid only during the "
                        "receive handler's call, or while an export made then lives (copy them, "
                        "or keep numpy.frombuffer(view) rather than view.obj)");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->len, 1, flags) < 0) return -1;
    self->exports++;
    return 0;
}

static void recview_let_go(RecView *self);

static void recview_releasebuffer(RecView *self, Py_buffer *view) {
    if (--self->exports == 0) {
        if (self->done) { /* its pin goes now: the space may be reused */
            self->ptr = NULL;
            self->len = 0;
        }
        recview_let_go(self);
    }
}

static void recview_dealloc(RecView *self) {
    End *e = (End *)self->owner;
    if (e && --e->views == 0 && e->detach_pending && !e->busy && e->waiters == 0) end_drop_late(e);
    Py_XDECREF(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs recview_as_buffer = {(getbufferproc)recview_getbuffer,
                                          (releasebufferproc)recview_releasebuffer};

static PyTypeObject RecViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmclient._ring.RecordBytes",
    .tp_basicsize = sizeof(RecView),
    .tp_dealloc = (destructor)recview_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The bytes of one record in the ring (read-only buffer).",
    .tp_as_buffer = &recview_as_buffer,
};

/* ------------------------------------------------------------------ consumer */

typedef struct {
    End e;
    uint64_t rpos;     /* bytes read */
    uint64_t head;     /* last head seen */
    uint64_t released; /* last tail stored */
    PyObject *frag;    /* bytes object of a message being reassembled, or NULL */
    uint64_t frag_off;
    uint8_t frag_type;
    PyObject *pinned;  /* list of [end_position, memoryview] a handler kept an export of */
    int space_fd;      /* write end of the producer's space pipe, or -1 */
    int head_bad;      /* a head that breaks the protocol was loaded (bad_head): not used */
    uint64_t bad_head;
} Consumer;

static void c_rearm(Consumer *c);

static int consumer_init(Consumer *self, PyObject *args, PyObject *kw) {
    PyObject *mapping;
    int fd = -1, space_fd = -1;
    static char *kwlist[] = {"mapping", "wake_fd", "space_fd", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|ii", kwlist, &mapping, &fd, &space_fd))
        return -1;
    if (end_init_once(&self->e) < 0) return -1;
    self->e.role = "consumer";
    if (end_init_buffer(&self->e, mapping) < 0) goto fail;
    self->e.pipe_fd = fd; /* our own write end of the wake pipe: see c_rearm */
    self->space_fd = space_fd;
    uint64_t tail = ld_acq(self->e.base, OFF_TAIL), head = ld_acq(self->e.base, OFF_HEAD);
    if (check_positions(&self->e, head, tail) < 0) goto fail;
    self->rpos = self->released = tail;
    self->head = self->rpos;
    self->pinned = PyList_New(0);
    if (!self->pinned) goto fail;
    c_rearm(self);
    self->e.gen = fork_gen; /* last: the end is usable */
    return 0;
fail: /* not initialised: every call refuses it (a later __init__ may still succeed) */
    end_drop_buffer(&self->e);
    return -1;
}

static void consumer_dealloc(Consumer *self) {
    Py_CLEAR(self->frag);
    Py_CLEAR(self->pinned);
    end_dealloc(&self->e);
}

/* 1: data, 2: the producer closed and nothing is left, 0: nothing yet. A new head is
   loaded once and kept only if the protocol allows it: a multiple of 8, not behind the
   read position, at most the capacity past the tail released (the producer cannot
   write further). Otherwise it is remembered in bad_head (1: the caller's take says so). */
static int c_data_ready(End *e) {
    Consumer *c = (Consumer *)e;
    if (c->head != c->rpos) return 1;
    uint32_t closed = atomic_load_explicit(U32(e->base, OFF_P_CLOSED), memory_order_acquire);
    uint64_t h = ld_acq(e->base, OFF_HEAD);
    if (h == c->rpos) return closed ? 2 : 0;
    if ((h - c->rpos > c->released + e->cap - c->rpos) | (int)(h & 7)) {
        c->bad_head = h;
        c->head_bad = 1;
        return 1;
    }
    c->head = h;
    return 1;
}

/* c_data_ready for a call that reads: -1 (the end closed, RingCorruptError) for a bad head */
static inline int c_ready_checked(Consumer *c) {
    int r = c_data_ready(&c->e);
    if (!c->head_bad) return r;
    uint64_t h = c->bad_head;
    return violation(&c->e, "head = %llu is not a multiple of 8 or outside [%llu, %llu] (the "
                     "read position, the bound: the released tail %llu + the capacity %llu)",
                     (unsigned long long)h, (unsigned long long)c->rpos,
                     (unsigned long long)(c->released + c->e.cap), (unsigned long long)c->released,
                     (unsigned long long)c->e.cap);
}

__attribute__((cold, noinline)) static int corrupt(Consumer *c, uint64_t pos, uint64_t n, const char *why) {
    return violation(&c->e, "record of %llu bytes at offset %llu of %llu (read position %llu, "
                     "head = %llu): %s", (unsigned long long)n, (unsigned long long)pos,
                     (unsigned long long)c->e.cap, (unsigned long long)c->rpos,
                     (unsigned long long)c->head, why);
}

/* Release everything read, up to the first record a handler still holds a view of. */
static int c_release(Consumer *c, uint64_t nrec, uint64_t nbytes) {
    uint64_t upto = c->rpos;
    Py_ssize_t n = PyList_GET_SIZE(c->pinned);
    if (n) {
        /* drop the pins whose views have been let go; the first one still held bounds us */
        Py_ssize_t keep = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *pair = PyList_GET_ITEM(c->pinned, i);
            RecView *rv = (RecView *)PyList_GET_ITEM(pair, 1);
            if (rv->exports == 0) continue;
            if (!keep) {
                uint64_t start = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(pair, 0));
                if (start < upto) upto = start;
            }
            keep = 1;
        }
        if (!keep) {
            if (PyList_SetSlice(c->pinned, 0, n, NULL) < 0) return -1;
        }
    }
    char *b = c->e.base;
    if (nrec) {
        stat_add(b, OFF_C_RECORDS, nrec);
        stat_add(b, OFF_C_BYTES, nbytes);
        stat_add(b, OFF_C_BATCHES, 1);
    }
    if (upto != c->released) {
        c->released = upto;
        st_rel(b, OFF_TAIL, upto);
        notify(b, OFF_P_WAIT, OFF_SPACE_SEQ, c->space_fd);
    }
    return 0;
}

/* The last export of a view a handler kept is gone (the array made from it dropped):
   release the space it pinned now, and wake a producer waiting for it, rather than at
   the consumer's next call, which may never come while that producer waits (a consumer
   parked on an empty ring). Only between the consumer's calls (a call in progress,
   which may be reading records past the pins, releases at its end) and in the process
   that made the end (a forked child's copy moves nothing of the parent's). Runs with
   the GIL held, as every call that moves the release point. */
static void recview_let_go(RecView *self) {
    Consumer *c = (Consumer *)self->owner;
    if (!c || c->e.busy || c->e.closed || c->e.broken || c->e.gen != fork_gen || !c->pinned ||
        PyList_GET_SIZE(c->pinned) == 0)
        return;
    PyObject *exc = get_raised(); /* a buffer may be released while an exception is set */
    if (c_release(c, 0, 0) < 0) PyErr_WriteUnraisable((PyObject *)c);
    if (exc) set_raised(exc);
}

/* One record at c->rpos (below head). Sets *msg to a new reference to the complete
   message's bytes (copy mode) or to NULL (a fragment in progress or a PAD). In view mode
   a whole record is returned as (*vptr, *vlen) with *msg NULL. Advances rpos. Returns
   0, or -1 with an exception (corrupt ring, no memory). */
static int c_one(Consumer *c, int views, uint8_t *type, PyObject **msg, char **vptr, uint64_t *vlen) {
    uint64_t cap = c->e.cap;
    uint64_t pos = c->rpos % cap; /* a multiple of 8: the header lies inside the ring */
    char *h = c->e.data + pos;
    /* the header (u32 length, u8 type, u8 flags) is loaded once; only the copy is used */
    uint64_t hdr = ld_once(h);
    uint32_t n = (uint32_t)hdr;
    uint8_t t = (uint8_t)(hdr >> 32), f = (uint8_t)(hdr >> 40);
    uint64_t size = ((uint64_t)n + 15) & ~7ULL;
    uint64_t avail = c->head - c->rpos; /* published and unread: <= cap (c_data_ready) */
    *msg = NULL;
    *vptr = NULL;
    *type = t;
    if (f & F_PAD) {
        if (cap - pos > avail) {
            violation(&c->e, "PAD at offset %llu covers %llu bytes to the end of the ring, past "
                      "head = %llu (read position %llu)", (unsigned long long)pos,
                      (unsigned long long)(cap - pos), (unsigned long long)c->head,
                      (unsigned long long)c->rpos);
            return -1;
        }
        c->rpos += cap - pos;
        return 0;
    }
    if (size > cap - pos) return corrupt(c, pos, n, "it crosses the end of the ring");
    if (size > avail) return corrupt(c, pos, n, "it ends past head");
    char *body = h + REC_HDR;
    if (f & (F_MORE | F_CONT)) {
        if (!(f & F_CONT)) {
            if (n < 8) return corrupt(c, pos, n, "a first fragment shorter than its total");
            uint64_t total = ld_once(body); /* 8-aligned, below head: loaded once */
            if (total > MAX_MESSAGE) {
                violation(&c->e, "a fragmented message announces total = %llu bytes, over the "
                          "bound %llu (the longest message)", (unsigned long long)total,
                          MAX_MESSAGE);
                return -1;
            }
            if (total < (uint64_t)n - 8) {
                violation(&c->e, "a fragmented message announces total = %llu bytes, less than "
                          "its first fragment (%llu bytes)", (unsigned long long)total,
                          (unsigned long long)(n - 8));
                return -1;
            }
            PyObject *fb = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
            if (!fb) {
                /* retrying could only fail the same way, forever: the stream stops here */
                PyObject *cause = get_raised();
                violation(&c->e, "the %llu bytes of a fragmented message cannot be allocated "
                          "(MemoryError)", (unsigned long long)total);
                if (cause) {
                    PyObject *err = get_raised();
                    PyException_SetCause(err, cause);
                    set_raised(err);
                }
                return -1;
            }
            Py_XSETREF(c->frag, fb);
            c->frag_type = t;
            memcpy(PyBytes_AS_STRING(fb), body + 8, n - 8);
            c->frag_off = n - 8;
        } else {
            if (!c->frag)
                /* a continuation without its start: the producer gave up on a message
                   we never saw the start of (it cannot happen in order) */
                return corrupt(c, pos, n, "a continuation without a first fragment");
            if (n > (uint64_t)PyBytes_GET_SIZE(c->frag) - c->frag_off)
                return corrupt(c, pos, n, "a continuation past its message's total");
            memcpy(PyBytes_AS_STRING(c->frag) + c->frag_off, body, n);
            c->frag_off += n;
        }
        c->rpos += size;
        if (!(f & F_MORE)) {
            if (c->frag_off != (uint64_t)PyBytes_GET_SIZE(c->frag))
                return corrupt(c, pos, n, "the last fragment ends before its message's total");
            *type = c->frag_type;
            *msg = c->frag;
            c->frag = NULL;
        }
        return 0;
    }
    if (c->frag) Py_CLEAR(c->frag); /* the producer abandoned that message half-way */
    c->rpos += size;
    if (views) {
        *vptr = body;
        *vlen = n;
        return 0;
    }
    *msg = PyBytes_FromStringAndSize(body, n);
    if (!*msg) {
        c->rpos -= size;
        return -1;
    }
    return 0;
}

/* With a wake pipe, the pipe must turn readable whenever a record is published and not
   yet read, whoever reads: after every read, ask the producer for a byte at its next
   publish (flag 2), fence, and re-check; a record that slipped in before the flag was
   seen gets the byte from us. */
static void c_rearm(Consumer *c) {
    if (c->e.pipe_fd < 0) return;
    char *b = c->e.base;
    atomic_fetch_or_explicit(U32(b, OFF_C_WAIT), 2, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    if (ld_acq(b, OFF_HEAD) != c->rpos) { /* (a close writes its own byte, once) */
        char x = 1;
        ssize_t r = write(c->e.pipe_fd, &x, 1);
        (void)r;
    }
}

/* take(): (type, bytes) for every record published now, their space released, in one
   call. */
static PyObject *consumer_take(Consumer *self, PyObject *const *args, Py_ssize_t nargs) {
    int mode = nargs > 0 ? mine_mode(args[0]) : E_FAST;
    if (mode < 0) return NULL;
    int entered = end_enter(&self->e, mode);
    if (entered) { /* declined: take the slow path */
        if (entered < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *inbox = PyList_New(0);
    if (!inbox) {
        end_leave(&self->e);
        return NULL;
    }
    uint64_t nrec = 0, nbytes = 0;
    int failed = 0;
    int ready = c_ready_checked(self);
    if (ready < 0) failed = 1;
    else if (ready == 1) {
        while (self->rpos != self->head) {
            uint8_t t;
            PyObject *msg;
            char *vp;
            uint64_t vl;
            if (c_one(self, 0, &t, &msg, &vp, &vl) < 0) { failed = 1; break; }
            if (!msg) continue;
            PyObject *item = Py_BuildValue("(BN)", t, msg);
            if (!item || PyList_Append(inbox, item) < 0) {
                Py_XDECREF(item);
                failed = 1;
                break;
            }
            Py_DECREF(item);
            nrec++;
            nbytes += (uint64_t)PyBytes_GET_SIZE(msg);
        }
    }
    PyObject *exc = NULL;
    if (failed) exc = get_raised();
    int rr = 0;
    if (!self->e.closed) { /* (a protocol violation closed it) */
        rr = c_release(self, nrec, nbytes);
        c_rearm(self);
    }
    end_leave(&self->e);
    if (exc) {
        /* what was taken before the failure is kept for the next call */
        if (rr < 0) PyErr_Clear();
        if (PyList_GET_SIZE(inbox)) {
            PyErr_Clear();
            Py_DECREF(exc);
            return inbox;
        }
        Py_DECREF(inbox);
        set_raised(exc);
        return NULL;
    }
    if (rr < 0) {
        Py_DECREF(inbox);
        return NULL;
    }
    return inbox;
}

/* recv_views(handler[, mine[, limit]]) -> count: handler(type, memoryview) for every
   record published now (at most `limit` messages when it is > 0: the rest stay for the
   next call, and a wake pipe is readable again at once); the view points into the ring. Space is released when the call ends; a view the handler
   kept an export of (e.g. numpy.frombuffer) pins its record until that export is gone.
   If the handler raises, that record counts as read and the exception propagates. */
static PyObject *consumer_recv_views(Consumer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "recv_views(handler[, mine])");
        return NULL;
    }
    PyObject *handler = args[0];
    int mode = nargs > 1 ? mine_mode(args[1]) : E_FAST;
    if (mode < 0) return NULL;
    unsigned long long limit = 0;
    if (nargs > 2) {
        limit = PyLong_AsUnsignedLongLong(args[2]);
        if (limit == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    int entered = end_enter(&self->e, mode);
    if (entered) { /* declined: take the slow path */
        if (entered < 0) return NULL;
        Py_RETURN_NONE;
    }
    uint64_t nrec = 0, nbytes = 0;
    int failed = 0;
    int ready = c_ready_checked(self);
    if (ready < 0) failed = 1;
    else if (ready == 1) {
        while (self->rpos != self->head) {
            uint8_t t;
            PyObject *msg;
            char *vp;
            uint64_t vl;
            uint64_t start = self->rpos;
            if (c_one(self, 1, &t, &msg, &vp, &vl) < 0) { failed = 1; break; }
            PyObject *view;
            RecView *rv = NULL;
            if (msg) {
                view = PyMemoryView_FromObject(msg);
                Py_DECREF(msg);
            } else if (vp) {
                rv = PyObject_New(RecView, &RecViewType);
                if (rv) {
                    rv->ptr = vp;
                    rv->len = (Py_ssize_t)vl;
                    rv->exports = 0;
                    rv->done = 0;
                    rv->owner = Py_NewRef((PyObject *)self);
                    self->e.views++;
                }
                view = rv ? PyMemoryView_FromObject((PyObject *)rv) : NULL;
            } else {
                continue;
            }
            if (!view) { Py_XDECREF(rv); failed = 1; break; }
            nrec++;
            nbytes += (uint64_t)PyMemoryView_GET_BUFFER(view)->len;
            PyObject *r = PyObject_CallFunction(handler, "BO", t, view);
            Py_XDECREF(r);
            PyObject *exc = r ? NULL : get_raised();
            PyObject *rel = PyObject_CallMethod(view, "release", NULL);
            if (rel) Py_DECREF(rel);
            else PyErr_Clear(); /* the handler kept an export of our own memoryview */
            Py_DECREF(view);
            if (rv) {
                rv->done = 1;
                if (rv->exports == 0 || self->e.closed) { /* nothing reads it: released */
                    rv->ptr = NULL;
                    rv->len = 0;
                }
                /* something made from the view still reads it; not once the end is closed
                   (by the handler, or another thread meanwhile): close let go of the pins,
                   and a pin added after it would never be (a cycle through the end that the
                   cyclic GC cannot see: the ring's mapping kept for the process's life) */
                if (rv->exports > 0 && !self->e.closed) {
                    PyObject *pair = Py_BuildValue("[KO]", (unsigned long long)start, (PyObject *)rv);
                    if (!pair || PyList_Append(self->pinned, pair) < 0) PyErr_Clear();
                    Py_XDECREF(pair);
                }
                Py_DECREF(rv);
            }
            if (self->e.gen != fork_gen) { /* the handler forked: this is the child */
                if (!exc) {
                    end_forked(&self->e);
                    exc = get_raised();
                }
            }
            if (exc) {
                set_raised(exc);
                failed = 1;
                break;
            }
            if (self->e.closed) break; /* the handler closed this end */
            if (limit && nrec >= limit) break;
        }
    }
    PyObject *exc = failed ? get_raised() : NULL;
    int rr = 0;
    if (!self->e.closed && self->e.gen == fork_gen) {
        rr = c_release(self, nrec, nbytes);
        c_rearm(self);
    }
    end_leave(&self->e);
    if (exc) {
        if (rr < 0) PyErr_Clear();
        set_raised(exc);
        return NULL;
    }
    if (rr < 0) return NULL;
    return PyLong_FromUnsignedLongLong(nrec);
}

static PyObject *consumer_wait(Consumer *self, PyObject *args) {
    if (end_forked(&self->e) < 0) return NULL;
    if (self->e.broken) return (end_closed_error(&self->e), NULL);
    return end_wait_method(&self->e, args, c_data_ready, OFF_C_WAIT, OFF_DATA_SEQ, OFF_C_SPINS,
                           OFF_C_BLOCKS, 0);
}

static PyObject *consumer_poll(Consumer *self, PyObject *unused) {
    /* reads what a wait reads, so it may run while another thread's call is inside (a
       head that breaks the protocol reads as data: the next take says what is wrong) */
    if (end_check(&self->e) < 0) return NULL;
    return PyLong_FromLong(c_data_ready(&self->e));
}

static PyObject *consumer_close_impl(End *e) {
    Consumer *self = (Consumer *)e;
    if (!self->e.closed) {
        Py_CLEAR(self->frag);
        if (self->pinned) {
            /* the exports alive keep reading (the mapping stays while they do); no new one */
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->pinned); i++) {
                RecView *rv = (RecView *)PyList_GET_ITEM(PyList_GET_ITEM(self->pinned, i), 1);
                rv->ptr = NULL;
                rv->len = 0;
            }
            PyList_SetSlice(self->pinned, 0, PyList_GET_SIZE(self->pinned), NULL);
        }
        PyErr_Clear();
        if (self->space_fd >= 0) { /* a producer parked on its space pipe sees the close */
            char x = 1;
            ssize_t r = write(self->space_fd, &x, 1);
            (void)r;
        }
    }
    return end_close_common(&self->e, OFF_C_CLOSED);
}

static PyObject *consumer_close(Consumer *self, PyObject *unused) {
    if (end_forked(&self->e) < 0) return NULL;
    return consumer_close_impl(&self->e);
}

/* forget() of a consumer: its pins (the parent's views a handler kept) go first; a view
   this child still holds keeps the mapping (see end_forget). */
static PyObject *consumer_forget(Consumer *self, PyObject *args) {
    if (self->e.gen && self->e.gen != fork_gen) {
        Py_CLEAR(self->frag);
        if (self->pinned && PyList_SetSlice(self->pinned, 0, PyList_GET_SIZE(self->pinned), NULL) < 0)
            return NULL;
    }
    return end_forget(&self->e, args);
}

static PyObject *consumer_rearm(Consumer *self, PyObject *unused) {
    int entered = end_enter(&self->e, E_SKIP);
    if (entered) { /* another thread's call rearms when it ends */
        if (entered < 0) return NULL;
        Py_RETURN_NONE;
    }
    c_rearm(self);
    end_leave(&self->e);
    Py_RETURN_NONE;
}

static PyObject *consumer_unpin(Consumer *self, PyObject *unused) {
    int entered = end_enter(&self->e, E_SKIP);
    if (entered) { /* another thread's call releases when it ends */
        if (entered < 0) return NULL;
        return PyLong_FromSsize_t(PyList_GET_SIZE(self->pinned));
    }
    int rr = c_release(self, 0, 0);
    end_leave(&self->e);
    if (rr < 0) return NULL;
    return PyLong_FromSsize_t(PyList_GET_SIZE(self->pinned));
}

static PyObject *consumer_get_pinned(Consumer *self, void *c) {
    if (end_made(&self->e) < 0) return NULL;
    return PyLong_FromSsize_t(PyList_GET_SIZE(self->pinned));
}

static PyObject *consumer_get_reassembling(Consumer *self, void *c) {
    if (end_made(&self->e) < 0) return NULL;
    return PyBool_FromLong(self->frag != NULL);
}

static PyMethodDef consumer_methods[] = {
    {"take", (PyCFunction)(void (*)(void))consumer_take, METH_FASTCALL,
     "take(mine=False) -> list of (type, bytes) of every record published now, their space "
     "released, in one call. mine false (the lock-free fast path): None when another thread's "
     "slow path holds the end, another thread's call is running, or the end is closed. mine "
     "true (the caller holds the lock): waits, without the GIL, for another thread's call to "
     "end; mine=2: None instead of waiting. Never waits for data."},
    {"recv_views", (PyCFunction)(void (*)(void))consumer_recv_views, METH_FASTCALL,
     "recv_views(handler, mine=False, limit=0) -> n: handler(type, memoryview) per record, "
     "in place, at most limit messages (0: all); mine and None as for take(). A handler that "
     "uses this end raises RuntimeError. Never waits for data."},
    {"wait", (PyCFunction)consumer_wait, METH_VARARGS,
     "wait(spin_s, timeout_s) -> 0 data after spinning, 1 after spinning and sleeping, 2 "
     "timed out, 3 the producer closed and everything was read, 4 after sleeping without a "
     "spin (spin 0 or the spin gate's veto). The spin may outlast the timeout; a vetoed "
     "spin never does. Releases the GIL only while asleep; a signal "
     "handler's exception propagates."},
    {"rearm", (PyCFunction)consumer_rearm, METH_NOARGS,
     "Ask for a wake byte at the next publish; write one now if a record is unread."},
    {"unpin", (PyCFunction)consumer_unpin, METH_NOARGS,
     "Release the space of records whose kept views have been dropped; -> pins left."},
    {"poll", (PyCFunction)consumer_poll, METH_NOARGS, "1 data, 2 producer closed, 0 nothing."},
    {"close", (PyCFunction)consumer_close, METH_NOARGS,
     "Mark this side closed and wake every waiter. Idempotent."},
    {"detach", (PyCFunction)end_detach, METH_VARARGS,
     "detach(on_drop=None): drop the mapping (after close); while a call, view or waiter "
     "still uses it, the last of them drops it and calls on_drop()."},
    {"forget", (PyCFunction)consumer_forget, METH_VARARGS,
     "forget(on_drop=None): in a forked child, drop the parent's mapping without writing to "
     "it (while this thread's call or a view uses it, later, then on_drop())."},
    {NULL}};

static PyObject *consumer_get_peer_closed(Consumer *self, void *c) {
    if (end_forked(&self->e) < 0) return NULL;
    if (!self->e.base) Py_RETURN_FALSE;
    return PyBool_FromLong(atomic_load_explicit(U32(self->e.base, OFF_P_CLOSED), memory_order_acquire));
}

static PyGetSetDef consumer_getset[] = {
    {"peer_closed", (getter)consumer_get_peer_closed, NULL, "the producer has closed", NULL},
    {"capacity", (getter)end_get_capacity, NULL, "the capacity this end read (once) and uses", NULL},
    {"held", (getter)end_get_held, (setter)end_set_held, "a slow path holds this end", NULL},
    {"pinned", (getter)consumer_get_pinned, NULL, "records held by views still exported", NULL},
    {"reassembling", (getter)consumer_get_reassembling, NULL, "a fragmented message is half read", NULL},
    {NULL}};

static PyTypeObject ConsumerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmclient._ring.Consumer",
    .tp_basicsize = sizeof(Consumer),
    .tp_dealloc = (destructor)consumer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Consumer(mapping, wake_fd=-1, space_fd=-1): the reading end over a mapped ring; "
               "space_fd: the write end of the producer's space pipe, if it has one; wake_fd: "
               "the write end of its own wake pipe, if it has one.",
    .tp_methods = consumer_methods,
    .tp_getset = consumer_getset,
    .tp_init = (initproc)consumer_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ spin gate object */

/* SpinGate(mode="adaptive"): the spin gate's decisions over observations given by the
   caller (for tests); ``_ring.gate`` is the process's own gate, the one every wait reads. */
typedef struct {
    PyObject_HEAD
    Gate own;
    Gate *g;
} GateObj;

static int gate_parse_mode(PyObject *o) {
    const char *m = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
    int r = m ? gate_mode_of(m) : -1;
    if (r < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "spin mode must be 'adaptive', 'always' or 'never', got %R", o);
    }
    return r;
}

/* Made without __init__ (SpinGate.__new__), a gate is what SpinGate() makes: its own,
   adaptive; never one without a gate behind it. */
static PyObject *gateobj_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    GateObj *self = (GateObj *)PyType_GenericNew(type, args, kw);
    if (!self) return NULL;
    gate_init(&self->own, GATE_ADAPTIVE);
    self->g = &self->own;
    return (PyObject *)self;
}

static int gateobj_init(GateObj *self, PyObject *args, PyObject *kw) {
    PyObject *mode = NULL;
    static char *kwlist[] = {"mode", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|U", kwlist, &mode)) return -1;
    int m = mode ? gate_parse_mode(mode) : GATE_ADAPTIVE;
    if (m < 0) return -1;
    gate_init(&self->own, m);
    self->g = &self->own;
    return 0;
}

static PyObject *gateobj_host(GateObj *self, PyObject *args) {
    double now, quota;
    long nr, cpus;
    if (!PyArg_ParseTuple(args, "dlld", &now, &nr, &cpus, &quota)) return NULL;
    gate_host(self->g, now, nr, cpus, quota);
    Py_RETURN_NONE;
}

static PyObject *gateobj_preempted(GateObj *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    gate_preempted(self->g, now);
    Py_RETURN_NONE;
}

static PyObject *gateobj_gap(GateObj *self, PyObject *args) {
    double now, gap;
    int switched;
    if (!PyArg_ParseTuple(args, "ddp", &now, &gap, &switched)) return NULL;
    return PyBool_FromLong(gate_gap(self->g, now, gap, switched));
}

static PyObject *gateobj_clean(GateObj *self, PyObject *unused) {
    gate_clean(self->g);
    Py_RETURN_NONE;
}

static PyObject *gateobj_allows(GateObj *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(gate_allows(self->g, now));
}

static PyObject *gateobj_free_cpu(GateObj *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(gate_free_cpu(self->g, now));
}

static PyObject *gateobj_state(GateObj *self, PyObject *unused) {
    Gate *g = self->g;
    return Py_BuildValue("{sssOslslsdsdsdsKsKsKsK}", "mode", gate_modes[g->mode], "host_ok",
                         g->host_ok ? Py_True : Py_False, "nr_running", g->nr_running, "cpus",
                         g->cpus, "quota_cpus", g->quota_cpus, "hold_s", g->hold_s, "hold_until",
                         g->hold_until, "spins_allowed", g->spins_allowed, "spins_denied",
                         g->spins_denied, "preemptions", g->preemptions, "samples", g->samples);
}

static PyObject *gateobj_get_mode(GateObj *self, void *c) {
    return PyUnicode_FromString(gate_modes[self->g->mode]);
}

static int gateobj_set_mode(GateObj *self, PyObject *v, void *c) {
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "the mode cannot be deleted");
        return -1;
    }
    int m = gate_parse_mode(v);
    if (m < 0) return -1;
    self->g->mode = m;
    return 0;
}

static PyMethodDef gate_methods[] = {
    {"host", (PyCFunction)gateobj_host, METH_VARARGS,
     "host(now, nr_running, cpus, quota_cpus): a reading of the host (cpus 0: do not compare "
     "the run queue; quota_cpus 0: no quota)."},
    {"preempted", (PyCFunction)gateobj_preempted, METH_O, "preempted(now): a spin lost its CPU."},
    {"gap", (PyCFunction)gateobj_gap, METH_VARARGS,
     "gap(now, gap_s, switched) -> whether a spin must stop: a gap between its clock reads "
     "with an involuntary switch in it (preempted: the gate closes); a gap without one is "
     "the hypervisor's or an interrupt's time."},
    {"clean", (PyCFunction)gateobj_clean, METH_NOARGS, "A spin ended without losing its CPU."},
    {"allows", (PyCFunction)gateobj_allows, METH_O, "allows(now) -> whether a waiter may spin."},
    {"free_cpu", (PyCFunction)gateobj_free_cpu, METH_O,
     "free_cpu(now) -> whether a thread woken now finds a CPU beside the runnable ones (the host "
     "read again when its last reading is older than the sample interval; True in mode 'always'). "
     "Counts no spin."},
    {"state", (PyCFunction)gateobj_state, METH_NOARGS, "The last readings and the counters."},
    {NULL}};

static PyGetSetDef gate_getset[] = {
    {"mode", (getter)gateobj_get_mode, (setter)gateobj_set_mode,
     "'adaptive', 'always' (never closed) or 'never' (always closed)", NULL},
    {NULL}};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmclient._ring.SpinGate",
    .tp_basicsize = sizeof(GateObj),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SpinGate(mode='adaptive'): whether a waiter may spin, from observations of the "
              "host (see _spin_gate.h). _ring.gate is the one every wait of this process reads.",
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
    .tp_init = (initproc)gateobj_init,
    .tp_new = gateobj_new,
};

/* ------------------------------------------------------------------ module */

static PyObject *mod_init_header(PyObject *m, PyObject *args) {
    PyObject *mapping;
    unsigned long long cap;
    if (!PyArg_ParseTuple(args, "OK", &mapping, &cap)) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(mapping, &b, PyBUF_WRITABLE) < 0) return NULL;
    if (cap < 64 || cap % 8 || b.len < HEADER_BYTES || cap > (uint64_t)b.len - HEADER_BYTES) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "capacity does not fit the mapping");
        return NULL;
    }
    memset(b.buf, 0, HEADER_BYTES);
    char *base = (char *)b.buf;
    *(uint64_t *)(base + OFF_CAPACITY) = cap;
    *(uint64_t *)(base + OFF_VERSION) = VERSION;
    atomic_store_explicit(U64(base, OFF_MAGIC), MAGIC, memory_order_release);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *mod_stats(PyObject *m, PyObject *mapping) {
    Py_buffer b;
    if (PyObject_GetBuffer(mapping, &b, PyBUF_SIMPLE) < 0) return NULL;
    if (b.len < HEADER_BYTES) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "mapping is smaller than a ring header");
        return NULL;
    }
    char *base = (char *)b.buf;
#define G(off) (unsigned long long)atomic_load_explicit(U64(base, off), memory_order_relaxed)
    PyObject *d = Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}",
        "capacity", G(OFF_CAPACITY), "head", G(OFF_HEAD), "tail", G(OFF_TAIL),
        "tx_records", G(OFF_P_RECORDS), "tx_bytes", G(OFF_P_BYTES), "tx_batches", G(OFF_P_BATCHES),
        "tx_spins", G(OFF_P_SPINS), "tx_blocks", G(OFF_P_BLOCKS), "wraps", G(OFF_WRAPS),
        "waits_on_full", G(OFF_WAITS_FULL), "fragments", G(OFF_FRAGMENTS),
        "rx_records", G(OFF_C_RECORDS), "rx_bytes", G(OFF_C_BYTES), "rx_batches", G(OFF_C_BATCHES),
        "rx_spins", G(OFF_C_SPINS), "rx_blocks", G(OFF_C_BLOCKS));
#undef G
    PyObject *flags = Py_BuildValue(
        "(II)", (unsigned)atomic_load_explicit(U32(base, OFF_P_CLOSED), memory_order_acquire),
        (unsigned)atomic_load_explicit(U32(base, OFF_C_CLOSED), memory_order_acquire));
    PyBuffer_Release(&b);
    if (!d || !flags) {
        Py_XDECREF(d);
        Py_XDECREF(flags);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, d, flags);
    Py_DECREF(d);
    Py_DECREF(flags);
    return res;
}

static PyMethodDef mod_methods[] = {
    {"init_header", mod_init_header, METH_VARARGS,
     "init_header(mapping, capacity): write a fresh header (creator only, before sharing)."},
    {"stats", mod_stats, METH_O,
     "stats(mapping) -> (counters dict, (producer_closed, consumer_closed))."},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_ring", RING_DOC, -1, mod_methods};

/* ---- try_hold: a non-blocking lock acquire that an asynchronous exception cannot split ----
 * `if lock.acquire(False): try: ... finally: lock.release()` has a gap: CPython runs
 * Python signal handlers (SIGINT -> KeyboardInterrupt) at the eval-breaker check right
 * after a call returns, so the exception can come after acquire() returned True and
 * before the try: the lock then stays held for good. `with try_hold(lock) as held:`
 * closes it: __enter__ acquires from C (no Python code runs, no eval-breaker check, and no
 * allocation that could start the garbage collector) and records whether it did; once
 * __enter__ returned, the with statement calls __exit__ for certain, which releases only
 * what __enter__ acquired. One guard per use (threads must not share one). */
typedef struct {
    PyObject_HEAD
    PyObject *lock;
    PyObject *timeout; /* NULL: do not block */
    int held;
} TryHoldObj;

static PyObject *try_hold_acquire_name, *try_hold_release_name;

static void try_hold_dealloc(TryHoldObj *self) {
    Py_XDECREF(self->lock);
    Py_XDECREF(self->timeout);
    PyObject_Free(self);
}

static PyObject *try_hold_enter(TryHoldObj *self, PyObject *unused) {
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "try_hold: this guard already holds its lock");
        return NULL;
    }
    /* A timed acquire that a signal interrupts runs the handlers inside acquire(); one
     * that raises makes acquire() fail without the lock: nothing is held then. */
    PyObject *args[3] = {self->lock, self->timeout ? Py_True : Py_False, self->timeout};
    PyObject *got = PyObject_VectorcallMethod(try_hold_acquire_name, args, self->timeout ? 3 : 2, NULL);
    if (!got) return NULL;
    int ok = PyObject_IsTrue(got);
    Py_DECREF(got);
    if (ok < 0) return NULL;
    self->held = ok;
    return PyBool_FromLong(ok);
}

static PyObject *try_hold_exit(TryHoldObj *self, PyObject *const *args, Py_ssize_t nargs) {
    if (self->held) {
        self->held = 0;
        PyObject *res = PyObject_VectorcallMethod(try_hold_release_name, &self->lock, 1, NULL);
        if (!res) return NULL;
        Py_DECREF(res);
    }
    Py_RETURN_FALSE; /* never swallows the body's exception */
}

static PyMethodDef try_hold_methods[] = {
    {"__enter__", (PyCFunction)try_hold_enter, METH_NOARGS,
     "lock.acquire(False); returns whether it acquired."},
    {"__exit__", (PyCFunction)(void (*)(void))try_hold_exit, METH_FASTCALL,
     "Release the lock if __enter__ acquired it."},
    {NULL}};

static PyTypeObject TryHoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmclient._ring.TryHold",
    .tp_basicsize = sizeof(TryHoldObj),
    .tp_dealloc = (destructor)try_hold_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A non-blocking acquire of a lock for a with statement (see try_hold).",
    .tp_methods = try_hold_methods,
};

static PyObject *mod_try_hold(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "try_hold(lock[, timeout]) takes 1 or 2 arguments");
        return NULL;
    }
    PyObject *timeout = nargs == 2 && args[1] != Py_None ? args[1] : NULL;
    if (timeout && !PyFloat_Check(timeout) && !PyLong_Check(timeout)) {
        PyErr_Format(PyExc_TypeError, "try_hold: timeout must be a number of seconds, not %.100s",
                     Py_TYPE(timeout)->tp_name);
        return NULL;
    }
    TryHoldObj *self = PyObject_New(TryHoldObj, &TryHoldType);
    if (!self) return NULL;
    Py_INCREF(args[0]);
    self->lock = args[0];
    Py_XINCREF(timeout);
    self->timeout = timeout;
    self->held = 0;
    return (PyObject *)self;
}

static PyMethodDef try_hold_def = {
    "try_hold", (PyCFunction)(void (*)(void))mod_try_hold, METH_FASTCALL,
    "try_hold(lock, timeout=None): `with try_hold(lock) as held:` takes lock without blocking "
    "(with timeout: waiting up to that many seconds; held: whether it did) and releases it at the "
    "end only if it did; no exception (a signal handler's included) can come between the acquire "
    "and the guard that releases it."};

/* Adds try_hold to the module (called from PyInit__ring). */
static int try_hold_add(PyObject *m) {
    if (PyType_Ready(&TryHoldType) < 0) return -1;
    try_hold_acquire_name = PyUnicode_InternFromString("acquire");
    try_hold_release_name = PyUnicode_InternFromString("release");
    if (!try_hold_acquire_name || !try_hold_release_name) return -1;
    PyObject *name = PyModule_GetNameObject(m);
    if (!name) return -1;
    PyObject *fn = PyCFunction_NewEx(&try_hold_def, NULL, name);
    Py_DECREF(name);
    if (!fn) return -1;
    return PyModule_AddObject(m, "try_hold", fn) < 0 ? (Py_DECREF(fn), -1) : 0;
}

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&ProducerType) < 0 || PyType_Ready(&ConsumerType) < 0 ||
        PyType_Ready(&RecViewType) < 0 || PyType_Ready(&GateType) < 0)
        return NULL;
    const char *env_mode = getenv("SHMCLIENT_SPIN");
    int mode = gate_mode_of(env_mode);
    if (mode < 0) { /* shmclient.errors.ConfigError (a ValueError), naming the variable */
        PyObject *errors = PyImport_ImportModule("shmclient.errors");
        PyObject *config_error = errors ? PyObject_GetAttrString(errors, "ConfigError") : NULL;
        Py_XDECREF(errors);
        if (!config_error) return NULL;
        PyErr_Format(config_error,
                     "SHMCLIENT_SPIN must be 'adaptive', 'always' or 'never', got '%s'", env_mode);
        Py_DECREF(config_error);
        return NULL;
    }
    gate_init(&the_gate, mode);
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    PyObject *errors = PyImport_ImportModule("shmclient.errors");
    if (!errors) return NULL;
    CorruptError = PyObject_GetAttrString(errors, "RingCorruptError");
    ForkedError = PyObject_GetAttrString(errors, "ForkedError");
    ClosedError = PyObject_GetAttrString(errors, "ClientClosedError");
    Py_DECREF(errors);
    if (!CorruptError || !ForkedError || !ClosedError) return NULL;
    Py_INCREF(CorruptError);
    if (PyModule_AddObject(m, "RingCorruptError", CorruptError) < 0) return NULL;
    static int hooked;
    if (!hooked) {
        if (pthread_atfork(NULL, NULL, in_forked_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return NULL;
        }
        hooked = 1;
    }
    Py_INCREF(&ProducerType);
    Py_INCREF(&ConsumerType);
    if (PyModule_AddObject(m, "Producer", (PyObject *)&ProducerType) < 0 ||
        PyModule_AddObject(m, "Consumer", (PyObject *)&ConsumerType) < 0)
        return NULL;
    GateObj *gate = PyObject_New(GateObj, &GateType);
    if (!gate) return NULL;
    gate->g = &the_gate;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "SpinGate", (PyObject *)&GateType) < 0 ||
        PyModule_AddObject(m, "gate", (PyObject *)gate) < 0)
        return NULL;
    PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES);
    PyModule_AddIntConstant(m, "REC_HDR", REC_HDR);
    PyModule_AddIntConstant(m, "VERSION", VERSION);
    if (PyModule_AddObject(m, "MAX_MESSAGE", PyLong_FromUnsignedLongLong(MAX_MESSAGE)) < 0) return NULL;
    PyModule_AddIntConstant(m, "READY", W_READY);
    PyModule_AddIntConstant(m, "WOKEN", W_WOKEN);
    PyModule_AddIntConstant(m, "TIMEOUT", W_TIMEOUT);
    PyModule_AddIntConstant(m, "CLOSED", W_CLOSED);
    PyModule_AddIntConstant(m, "SLEPT", W_SLEPT);
    if (try_hold_add(m) < 0) return NULL;
    return m;
}

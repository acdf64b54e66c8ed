/* The spin gate: whether a ring waiter may spin at all on this host right now.

Included by _ring.c only. A spin pays only when the peer it waits for has a CPU of its own
meanwhile; on a host with more runnable threads than CPUs (busy processes, a CPU quota,
GPU workers polling with sched_yield) a spinning waiter takes the CPU its peer, or other
people's work, needs, and waking it costs more than sleeping at once. The gate is one
per process (host state is not per ring) and is read and written under the GIL only.

It closes on any of these observations, and the waiter then sleeps at once:
* run queue: /proc/loadavg's count of runnable threads (this one included) exceeds the
  CPUs that can run us. Read at most every GATE_SAMPLE_S, ~1 us a read (one pread);
  skipped when this process's affinity is narrower than the host (pinned cores are the
  user's statement that they are ours; preemption still closes the gate);
* a CPU quota (cgroup v2 cpu.max, v1 cpu.cfs_quota_us, the tightest on the way to the
  root) below GATE_MIN_QUOTA CPUs: the spin burns the quota the peer needs. Read at most
  every GATE_QUOTA_S;
* preemption: a gap of more than GATE_PREEMPT_S between two of the spin's own clock
  reads (normally ~1 us apart) with an involuntary context switch of the spinning thread
  in it (getrusage, RUSAGE_THREAD: ~0.3 us, once at the start of a spin and once per
  gap) means another thread took the spinner's CPU. A gap without one is time taken by
  the hypervisor (steal) or an interrupt: a sleep would not have avoided it, and the spin
  goes on. On a preemption the spin ends at once and the gate stays closed for a hold-off that doubles while preemptions keep coming
  (GATE_HOLD_MIN_S .. GATE_HOLD_MAX_S) and is forgotten after a spin that was not
  preempted.
It opens again when the next reading shows a free CPU (and the hold-off is over).

SHMCLIENT_SPIN (environment, read at import): "adaptive" (default: the gate above),
"always" (no gate: spin as configured; for dedicated, pinned cores) or "never".

The decisions are plain functions of the observations (gate_host, gate_gap,
gate_preempted, gate_clean, gate_allows) so that tests can feed them sequences; gate_spin_ok() and
gate_free_cpu() are the ones that read the host. */

#ifndef SHMCLIENT_SPIN_GATE_H
#define SHMCLIENT_SPIN_GATE_H

#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GATE_SAMPLE_S 2e-3
#define GATE_QUOTA_S 1.0
#define GATE_PREEMPT_S 30e-6
#define GATE_HOLD_MIN_S 20e-3
#define GATE_HOLD_MAX_S 1.0
#define GATE_MIN_QUOTA 2.0

#define GATE_ADAPTIVE 0
#define GATE_ALWAYS 1
#define GATE_NEVER 2

typedef struct {
    int mode;
    /* the last readings */
    int host_ok;          /* the run queue and the quota leave the peer a CPU */
    long nr_running;      /* runnable threads, host-wide (-1: unknown) */
    long cpus;            /* CPUs that may run this process (0: pinned, not compared) */
    double quota_cpus;    /* CPU quota in CPUs (0: none) */
    double next_sample, next_quota;
    /* preemption hold-off */
    double hold_until, hold_s;
    /* statistics */
    unsigned long long spins_allowed, spins_denied, preemptions, samples;
} Gate;

/* ---- decisions: pure functions of the observations ---- */

/* A reading of the host: runnable threads (us included), the CPUs they compete for (0:
   do not compare: pinned or unknown) and the quota (0: none). */
static void gate_host(Gate *g, double now, long nr_running, long cpus, double quota_cpus) {
    g->nr_running = nr_running;
    g->cpus = cpus;
    g->quota_cpus = quota_cpus;
    int quota_ok = quota_cpus <= 0 || quota_cpus >= GATE_MIN_QUOTA;
    int queue_ok = cpus <= 0 || nr_running < 0 || nr_running <= cpus;
    g->host_ok = quota_ok && queue_ok;
    g->next_sample = now + GATE_SAMPLE_S;
}

/* A spin lost its CPU at `now`: hold spinning off. */
static void gate_preempted(Gate *g, double now) {
    g->hold_s = g->hold_s > 0 ? g->hold_s * 2 : GATE_HOLD_MIN_S;
    if (g->hold_s > GATE_HOLD_MAX_S) g->hold_s = GATE_HOLD_MAX_S;
    g->hold_until = now + g->hold_s;
    g->preemptions++;
}

/* A gap of `gap_s` between two clock reads of a spin, `switched`: whether the thread
   was switched out involuntarily meanwhile. 1 (the spin must stop: preempted, the gate
   closes) or 0 (go on: no gap, or time the hypervisor or an interrupt took). */
static int gate_gap(Gate *g, double now, double gap_s, int switched) {
    if (gap_s <= GATE_PREEMPT_S || !switched) return 0;
    gate_preempted(g, now);
    return g->mode != GATE_ALWAYS; /* (counted; "always" spins on, as configured) */
}

/* A spin ran to its end (or to the data) without losing its CPU. */
static void gate_clean(Gate *g) { g->hold_s = 0; }

static int gate_allows(const Gate *g, double now) {
    if (g->mode == GATE_ALWAYS) return 1;
    if (g->mode == GATE_NEVER) return 0;
    return now >= g->hold_until && g->host_ok;
}

/* ---- readings ---- */

static int loadavg_fd = -1;

/* Runnable threads host-wide (the 4th field of /proc/loadavg, "R/T"), or -1. */
static long read_nr_running(void) {
    if (loadavg_fd < 0) {
        loadavg_fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
        if (loadavg_fd < 0) return -1;
    }
    char buf[128];
    ssize_t n = pread(loadavg_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    /* "0.19 0.17 0.07 1/79 2452" */
    char *p = buf;
    for (int f = 0; f < 3; f++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    char *end;
    long r = strtol(p, &end, 10);
    if (end == p || *end != '/') return -1;
    return r;
}

/* The quota of one cgroup directory in CPUs, 0 for none, -1 if unreadable. */
static double quota_of(const char *dir, int v2) {
    char path[4400], buf[64];
    if (v2) {
        snprintf(path, sizeof path, "%s/cpu.max", dir);
        FILE *f = fopen(path, "re");
        if (!f) return -1;
        char q[32] = {0};
        long period = 0;
        int got = fscanf(f, "%31s %ld", q, &period);
        fclose(f);
        if (got != 2 || period <= 0) return -1;
        if (strcmp(q, "max") == 0) return 0;
        long quota = strtol(q, NULL, 10);
        return quota > 0 ? (double)quota / (double)period : 0;
    }
    long quota = 0, period = 0;
    snprintf(path, sizeof path, "%s/cpu.cfs_quota_us", dir);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
    fclose(f);
    quota = strtol(buf, NULL, 10);
    if (quota <= 0) return 0;
    snprintf(path, sizeof path, "%s/cpu.cfs_period_us", dir);
    f = fopen(path, "re");
    if (!f) return -1;
    if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
    fclose(f);
    period = strtol(buf, NULL, 10);
    return period > 0 ? (double)quota / (double)period : 0;
}

/* The tightest CPU quota from this process's cgroup up to the root, in CPUs (0: none). */
static double read_quota_cpus(void) {
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f) return 0;
    char line[4096], rel[4096] = "";
    int v2 = 0, found = 0;
    while (fgets(line, sizeof line, f)) {
        char *a = strchr(line, ':');
        char *b = a ? strchr(a + 1, ':') : NULL;
        if (!b) continue;
        *b = 0;
        char *ctrls = a + 1, *p = b + 1;
        p[strcspn(p, "\n")] = 0;
        int is_v1_cpu = 0;
        for (char *t = strtok(ctrls, ","); t; t = strtok(NULL, ","))
            if (strcmp(t, "cpu") == 0) is_v1_cpu = 1;
        if (is_v1_cpu) {
            snprintf(rel, sizeof rel, "%s", p);
            v2 = 0;
            found = 1;
            break;
        }
        if (a == line + 1 && line[0] == '0' && *ctrls == 0 && !found) {
            snprintf(rel, sizeof rel, "%s", p);
            v2 = 1;
            found = 1; /* keep looking: a v1 cpu line wins */
        }
    }
    fclose(f);
    if (!found) return 0;
    const char *mount = NULL;
    if (v2) {
        mount = "/sys/fs/cgroup";
    } else if (access("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", R_OK) == 0) {
        mount = "/sys/fs/cgroup/cpu";
    } else if (access("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", R_OK) == 0) {
        mount = "/sys/fs/cgroup/cpu,cpuacct";
    } else {
        return 0;
    }
    double best = 0;
    char dir[4200];
    size_t len = strlen(rel);
    for (;;) {
        while (len > 1 && rel[len - 1] == '/') rel[--len] = 0;
        snprintf(dir, sizeof dir, "%s%s", mount, (len == 1 && rel[0] == '/') ? "" : rel);
        double q = quota_of(dir, v2);
        if (q > 0 && (best == 0 || q < best)) best = q;
        if (len <= 1) break;
        char *slash = strrchr(rel, '/');
        if (!slash) break;
        if (slash == rel) {
            rel[1] = 0;
            len = 1;
        } else {
            *slash = 0;
            len = (size_t)(slash - rel);
        }
    }
    return best;
}

/* Involuntary context switches of the calling thread so far (-1: unknown). */
static long involuntary_switches(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) != 0) return -1;
    return ru.ru_nivcsw;
}

static long online_cpus = 0;
static long affinity_cpus = 0;

static long read_affinity(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
    return CPU_COUNT(&set);
}

/* Read the host when the last reading is older than GATE_SAMPLE_S. */
static void gate_refresh(Gate *g, double now) {
    if (now < g->next_sample) return;
    if (now >= g->next_quota) {
        g->quota_cpus = read_quota_cpus();
        affinity_cpus = read_affinity();
        g->next_quota = now + GATE_QUOTA_S;
    }
    long cpus = online_cpus;
    if (affinity_cpus > 0 && affinity_cpus < online_cpus) cpus = 0; /* pinned */
    gate_host(g, now, read_nr_running(), cpus, g->quota_cpus);
    g->samples++;
}

/* Whether a peer woken now would find a CPU of its own: the gate's reading of the host
   (read again when old) leaves one beside the runnable threads (this one included; the
   sleeping peer is not among them), the quota is not below GATE_MIN_QUOTA, and no
   preemption hold-off runs; always in mode "always" (cores the user dedicated). For a
   caller that chooses between waking its peer at once and handing that to a thread of
   its own that runs while it blocks; counts no spin. */
static int gate_free_cpu(Gate *g, double now) {
    if (g->mode == GATE_ALWAYS) return 1;
    gate_refresh(g, now);
    if (now < g->hold_until) return 0;
    if (g->quota_cpus > 0 && g->quota_cpus < GATE_MIN_QUOTA) return 0;
    return g->cpus <= 0 || g->nr_running < 0 || g->nr_running < g->cpus;
}

/* Whether a waiter may spin now, reading the host when its last reading is old. */
static int gate_spin_ok(Gate *g, double now) {
    if (g->mode == GATE_ADAPTIVE) gate_refresh(g, now);
    int ok = gate_allows(g, now);
    if (ok) g->spins_allowed++;
    else g->spins_denied++;
    return ok;
}

static const char *const gate_modes[] = {"adaptive", "always", "never"};

/* The mode named `m` (NULL or "": adaptive), or -1 for an unknown name. */
static int gate_mode_of(const char *m) {
    if (!m || !*m) return GATE_ADAPTIVE;
    for (int i = 0; i < 3; i++)
        if (strcmp(m, gate_modes[i]) == 0) return i;
    return -1;
}

static void gate_init(Gate *g, int mode) {
    memset(g, 0, sizeof *g);
    g->mode = mode;
    g->nr_running = -1;
    g->host_ok = 1;
    if (online_cpus == 0) {
        online_cpus = sysconf(_SC_NPROCESSORS_ONLN);
        if (online_cpus < 1) online_cpus = 1;
    }
}

#endif

/* commtune's NCCL tuner plugin: NCCL's algorithm, protocol and channel count per call,
 * from a table measured by `python -m autotune nccl`.
 *
 * The table is the file named by COMMTUNE_NCCL_TUNER_TABLE, read once per communicator
 * (at the plugin's init), in the CSV format of NCCL's example tuner plugin:
 *
 *   collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks[,numPipeOps[,regBuff]]
 *
 * '#' starts a comment line; min_bytes..max_bytes is inclusive and is NCCL's nBytes for
 * the call (the whole buffer for allgather and reducescatter); channels -1 keeps NCCL's
 * own channel count; nNodes, nRanks, numPipeOps, regBuff -1 match anything. The first
 * row that matches a call decides it: its (algorithm, protocol) entry of NCCL's cost
 * table is set to 0 so that NCCL picks it, and its channel count is returned. A call no
 * row matches, or whose row names an algorithm/protocol NCCL has ruled out for it, keeps
 * NCCL's own choice.
 *
 * Never fails inside NCCL: a missing, unreadable or malformed table, or one with no row
 * for this communicator's ranks and nodes, is reported in one line (on stderr and through
 * NCCL's logger) and leaves every choice to NCCL. */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "nccl_tuner_api.h"

#define TABLE_ENV "COMMTUNE_NCCL_TUNER_TABLE"
#define PLUGIN_NAME "commtune"
#define MAX_ROWS 4096
#define MAX_LINE 1024
#define MAX_CHANNELS 128
#define MAX_MESSAGE 512

typedef struct {
  int coll;
  unsigned long long lo, hi; /* inclusive */
  int algo, proto, channels;
  long nodes, ranks, pipe_ops, reg_buff; /* -1: any */
  int line;
  int warned; /* the row's choice was unavailable once: said so */
} Row;

typedef struct {
  Row *rows;
  int n;
  ncclDebugLogger_t log;
} Context;

/* how many communicators NCCL initialized this plugin for, and how many calls a table row
 * decided: read (ctypes) by python -m autotune nccl to confirm that NCCL loaded the plugin */
unsigned long commtune_tuner_inits = 0;
unsigned long commtune_tuner_decided = 0;
/* the last call this plugin was asked about and the (algorithm, protocol) NCCL runs for it (-1: none):
 * NCCL's own pick where no row decided. Read by python -m autotune nccl to name NCCL's default. */
int commtune_tuner_last_coll = -1, commtune_tuner_last_algo = -1, commtune_tuner_last_proto = -1;
unsigned long long commtune_tuner_last_bytes = 0;

static const char *const COLLECTIVES[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
static const char *const ALGORITHMS[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
static const char *const PROTOCOLS[] = {"ll", "ll128", "simple"};
#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void say(ncclDebugLogger_t log, ncclDebugLogLevel level, const char *fmt, ...) {
  char msg[MAX_MESSAGE];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (log) log(level, NCCL_INIT | NCCL_TUNING, __FILE__, __LINE__, "%s", msg);
  if (level == NCCL_LOG_WARN) fprintf(stderr, "commtune NCCL tuner: %s\n", msg);
}

static int lookup(const char *word, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (strcasecmp(word, names[i]) == 0) return i;
  return -1;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  char *end = s + strlen(s);
  while (end > s && isspace((unsigned char)end[-1])) *--end = '\0';
  return s;
}

/* a whole decimal number in [lo, hi]; 0 when the text is not one */
static int parse_long(const char *text, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || errno || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

static int parse_bytes(const char *text, unsigned long long *out) {
  char *end;
  if (!isdigit((unsigned char)*text)) return 0;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (*end != '\0' || errno) return 0;
  *out = v;
  return 1;
}

static int any_or(long v, long want) { return v == -1 || v == want; }

/* one table line into *row; 0 and a reason in why[] when it is malformed */
static int parse_row(char *line, Row *row, char *why, size_t why_len) {
  char *fields[11];
  int n = 0;
  for (char *tok = line; n < 11;) {
    fields[n++] = tok;
    char *comma = strchr(tok, ',');
    if (!comma) break;
    *comma = '\0';
    tok = comma + 1;
  }
  if (n < 8 || n > 10) {
    snprintf(why, why_len, "%s%d fields where 8 to 10 are expected", n > 10 ? "more than " : "", n > 10 ? 10 : n);
    return 0;
  }
  for (int i = 0; i < n; i++) fields[i] = trim(fields[i]);
  long v;
  memset(row, 0, sizeof *row);
  if ((row->coll = lookup(fields[0], COLLECTIVES, COUNT(COLLECTIVES))) < 0) {
    snprintf(why, why_len, "unknown collective '%.40s'", fields[0]);
    return 0;
  }
  if (!parse_bytes(fields[1], &row->lo) || !parse_bytes(fields[2], &row->hi) || row->lo > row->hi) {
    snprintf(why, why_len, "min_bytes '%.30s' and max_bytes '%.30s' are not sizes with min <= max", fields[1],
             fields[2]);
    return 0;
  }
  if ((row->algo = lookup(fields[3], ALGORITHMS, COUNT(ALGORITHMS))) < 0) {
    snprintf(why, why_len, "unknown algorithm '%.40s'", fields[3]);
    return 0;
  }
  if ((row->proto = lookup(fields[4], PROTOCOLS, COUNT(PROTOCOLS))) < 0) {
    snprintf(why, why_len, "unknown protocol '%.40s'", fields[4]);
    return 0;
  }
  if (!parse_long(fields[5], -1, MAX_CHANNELS, &v) || v == 0) {
    snprintf(why, why_len, "channels '%.30s' is neither -1 nor 1..%d", fields[5], MAX_CHANNELS);
    return 0;
  }
  row->channels = (int)v;
  if (!parse_long(fields[6], -1, 1L << 30, &row->nodes) || row->nodes == 0 ||
      !parse_long(fields[7], -1, 1L << 30, &row->ranks) || row->ranks == 0) {
    snprintf(why, why_len, "nNodes '%.30s' or nRanks '%.30s' is neither -1 nor a positive count", fields[6], fields[7]);
    return 0;
  }
  row->pipe_ops = -1;
  row->reg_buff = -1;
  if (n >= 9 && (!parse_long(fields[8], -1, 1L << 30, &row->pipe_ops) || row->pipe_ops == 0)) {
    snprintf(why, why_len, "numPipeOps '%.30s' is neither -1 nor a positive count", fields[8]);
    return 0;
  }
  if (n == 10 && !parse_long(fields[9], -1, 1, &row->reg_buff)) {
    snprintf(why, why_len, "regBuff '%.30s' is not -1, 0 or 1", fields[9]);
    return 0;
  }
  return 1;
}

/* the rows of `path` that apply to nRanks and nNodes; -1 (and a reason) when the table is unusable */
static int load_table(const char *path, size_t nRanks, size_t nNodes, Row **out, char *why, size_t why_len) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(why, why_len, "cannot open the table %s (%s)", path, strerror(errno));
    return -1;
  }
  Row *rows = calloc(MAX_ROWS, sizeof *rows);
  if (!rows) {
    fclose(f);
    snprintf(why, why_len, "out of memory reading the table %s", path);
    return -1;
  }
  char line[MAX_LINE + 2];
  int lineno = 0, total = 0, kept = 0, bad = 0;
  long other_ranks = 0, other_nodes = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    size_t len = strlen(line);
    if (len == sizeof line - 1 && line[len - 1] != '\n' && !feof(f)) {
      snprintf(why, why_len, "table %s line %d is longer than %d characters", path, lineno, MAX_LINE);
      bad = 1;
      break;
    }
    char *text = trim(line);
    if (*text == '\0' || *text == '#') continue;
    Row row;
    char reason[MAX_MESSAGE / 2];
    if (!parse_row(text, &row, reason, sizeof reason)) {
      snprintf(why, why_len, "table %s line %d: %s", path, lineno, reason);
      bad = 1;
      break;
    }
    if (++total > MAX_ROWS) {
      snprintf(why, why_len, "table %s has more than %d rows", path, MAX_ROWS);
      bad = 1;
      break;
    }
    if (!any_or(row.ranks, (long)nRanks)) { other_ranks = row.ranks; continue; }
    if (!any_or(row.nodes, (long)nNodes)) { other_nodes = row.nodes; continue; }
    row.line = lineno;
    rows[kept++] = row;
  }
  if (!bad && ferror(f)) {
    snprintf(why, why_len, "cannot read the table %s", path);
    bad = 1;
  }
  fclose(f);
  if (!bad && total == 0) {
    snprintf(why, why_len, "table %s has no rows", path);
    bad = 1;
  }
  if (!bad && kept == 0) {
    if (other_ranks)
      snprintf(why, why_len, "table %s has no row for %zu ranks on %zu node(s) (it was written for %ld ranks)",
               path, nRanks, nNodes, other_ranks);
    else
      snprintf(why, why_len, "table %s has no row for %zu ranks on %zu node(s) (it was written for %ld node(s))",
               path, nRanks, nNodes, other_nodes);
    bad = 1;
  }
  if (bad) {
    free(rows);
    return -1;
  }
  *out = rows;
  return kept;
}

static ncclResult_t start(void **context, size_t nRanks, size_t nNodes, ncclDebugLogger_t log) {
  __atomic_fetch_add(&commtune_tuner_inits, 1, __ATOMIC_RELAXED);
  Context *ctx = calloc(1, sizeof *ctx);
  *context = ctx;
  if (!ctx) {
    say(log, NCCL_LOG_WARN, "out of memory: NCCL keeps its own choices");
    return ncclSuccess;
  }
  ctx->log = log;
  const char *path = getenv(TABLE_ENV);
  if (!path || !*path) {
    say(log, NCCL_LOG_INFO, "commtune NCCL tuner loaded without a table (%s unset): NCCL keeps its own choices",
        TABLE_ENV);
    return ncclSuccess;
  }
  char why[MAX_MESSAGE - 64];
  int n = load_table(path, nRanks, nNodes, &ctx->rows, why, sizeof why);
  if (n < 0) {
    say(log, NCCL_LOG_WARN, "%s: NCCL keeps its own choices", why);
    return ncclSuccess;
  }
  ctx->n = n;
  say(log, NCCL_LOG_INFO, "commtune NCCL tuner: table %s, %d rows for %zu ranks on %zu node(s)", path, n, nRanks,
      nNodes);
  return ncclSuccess;
}

/* NCCL's pick from its cost table: the smallest non-negative entry, the first in (algorithm,
 * protocol) order on a tie, as NCCL's topoGetAlgoInfo picks it */
static void note_pick(const float *table, int numAlgo, int numProto, ncclFunc_t coll, size_t nBytes) {
  int algo = -1, proto = -1;
  float best = 3600000000.0f;
  for (int a = 0; a < numAlgo; a++)
    for (int p = 0; p < numProto; p++)
      if (table[a * numProto + p] >= 0.0f && table[a * numProto + p] < best) {
        best = table[a * numProto + p];
        algo = a;
        proto = p;
      }
  commtune_tuner_last_coll = (int)coll;
  commtune_tuner_last_bytes = nBytes;
  commtune_tuner_last_algo = algo;
  commtune_tuner_last_proto = proto;
}

static ncclResult_t decide(void *context, ncclFunc_t coll, size_t nBytes, int numPipeOps, float **collCostTable,
                           int numAlgo, int numProto, int regBuff, int *nChannels) {
  Context *ctx = context;
  if (!ctx || !collCostTable) return ncclSuccess;
  /* NCCL passes float[numAlgo][numProto] cast to float** */
  float *table = (float *)collCostTable;
  for (int i = 0; i < ctx->n; i++) {
    Row *r = &ctx->rows[i];
    if (r->coll != (int)coll || nBytes < r->lo || nBytes > r->hi) continue;
    if (!any_or(r->pipe_ops, numPipeOps)) continue;
    if (r->reg_buff != -1 && (regBuff < 0 || r->reg_buff != regBuff)) continue;
    if (r->algo < numAlgo && r->proto < numProto && table[r->algo * numProto + r->proto] >= 0.0f) {
      table[r->algo * numProto + r->proto] = 0.0f;
      if (r->channels > 0 && nChannels) *nChannels = r->channels;
      __atomic_fetch_add(&commtune_tuner_decided, 1, __ATOMIC_RELAXED);
    } else if (!r->warned) {
      r->warned = 1;
      say(ctx->log, NCCL_LOG_INFO, "commtune NCCL tuner: table line %d (%s %s) is not available for %s of %zu bytes: "
          "NCCL keeps its own choice", r->line, ALGORITHMS[r->algo], PROTOCOLS[r->proto], COLLECTIVES[r->coll],
          nBytes);
    }
    break;
  }
  note_pick(table, numAlgo, numProto, coll, nBytes);
  return ncclSuccess;
}

static ncclResult_t stop(void *context) {
  Context *ctx = context;
  if (ctx) {
    free(ctx->rows);
    free(ctx);
  }
  return ncclSuccess;
}

static ncclResult_t init_v5(void **ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                            ncclNvlDomainInfo_v5_t *nvl, ncclTunerConstants_v5_t *constants) {
  (void)commId;
  (void)nvl;
  (void)constants;
  return start(ctx, nRanks, nNodes, log);
}

static ncclResult_t init_v3(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void **ctx) {
  return start(ctx, nRanks, nNodes, log);
}

static ncclResult_t decide_v3(void *context, ncclFunc_t coll, size_t nBytes, int numPipeOps, float **collCostTable,
                              int numAlgo, int numProto, int *nChannels) {
  return decide(context, coll, nBytes, numPipeOps, collCostTable, numAlgo, numProto, -1, nChannels);
}

const ncclTuner_v5_t ncclTunerPlugin_v5 = {PLUGIN_NAME, init_v5, decide, stop};
const ncclTuner_v4_t ncclTunerPlugin_v4 = {PLUGIN_NAME, init_v3, decide, stop};
const ncclTuner_v3_t ncclTunerPlugin_v3 = {PLUGIN_NAME, init_v3, decide_v3, stop};

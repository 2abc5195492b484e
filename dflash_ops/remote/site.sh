#!/usr/bin/env bash
# The one program dflash runs at a place to change it: a target's lock, releases, job and
# checkpoints. It is sent whole as ONE command, `bash -c "$(cat site.sh)" dflash-site COMMAND
# OPTIONS…` (over SSH, through `pct exec`, or as a local subprocess), values as named options,
# never pasted into the text. dflash_ops/remote/client.py builds the call and reads the answer.
#
#   deploy   --release ID --bundle-size N [--keep N] [--probe ARG]… [--check ARG]…
#            [--archive-to DIR] COMMON START -- TMUX-ARGS…   (the bundle's tar on stdin)
#   restart  [--archive-to DIR] COMMON START -- TMUX-ARGS…
#   rollback --release ID [--expect ID] COMMON START -- TMUX-ARGS…
#   stop     COMMON
#   prune-run --checkpoints DIR --run DIR   (delete one archived run, proven to be one)
#   venv     --venv DIR --python BASE --requirements TEXT [--torch-index URL --torch REQ]
#            [--wheels DIR] [--system-site 1] --probe ARG…   (build the job's venv, once)
#
#   COMMON: --root DIR --lock PATH --owner JSON [--stale RECORD] --checkpoints DIR
#           --socket NAME --session NAME --log FILE --stop-ticks INT,TERM,KILL
#           [--tool-timeout SECONDS]   (each tmux call's bound: see below)
#   START:  [--wait TICKS --ready TEXT]: after the start, wait (ticks of 0.1 s) until TEXT is in
#           the job's new log lines (empty: any line) or the job has ended (step `ready`)
#
# What a command does is announced on stdout as `step<TAB>NAME` before it runs; what a step
# found is `KEY<TAB>VALUE` (`removed`, `current`, `cleaned`, `stopped`, `survived`, `archived`,
# `logged`, `started`); a failed step prints `failed<TAB>STATUS` and exits 1. While it runs,
# `tick<TAB>SECONDS` comes every TICK seconds: a step that waits long (the job's stop, the
# trainer's check) is never silent, so the caller can tell it from a dead link, and the
# connection carries bytes from here, so sshd notices a caller that went away (its link cut) as
# soon as the link is back. Exit 3 with `holder<TAB>alive|gone|unknown` and `held<TAB>RECORD`
# (last): the lock is held. Exit 10: tmux or python failed the preflight. A value is at most
# SAY_MAX characters, and what a step quotes of a tool's output is bounded too: a tool that
# floods costs the place its time, never the caller its memory.
#
# The steps of deploy, in order: tmux, python (--probe) → lock → unpack → check (--check: the
# trainer's own check of the release's train.toml; a failure removes the unpacked release) →
# stop → switch → prune → archive (--archive-to) → start → ready → done. Nothing stops before
# the check passed. Restart reads `current` instead of unpacking; rollback checks that `current`
# is still --expect (`expect`), then switches after the stop; both first remove what killed
# deploys left in releases/ (`clean`); stop only stops.
#
# The stop is the point of no return (`hold_on`): a caller gone before it leaves everything as
# it was (nothing but a lock and an unfinished `.tmp` release was touched, and the lock goes);
# from it on, the command goes on to the end whatever becomes of its caller, so the place is
# never left without its job: the new release (deploy, rollback), the same one (restart).
#
# The steps run in their own process group, and until the stop this program never outlives
# the command that started it: stdin carries the bundle (exactly its size) and then stays open
# until the program exits. From the first byte a watcher is its only reader: it saves the
# bundle for the unpack step, then waits for the end of stdin, which comes early only when the
# caller was killed, its connection dropped or it let go (an interrupt), and then ends the group
# (the EXIT trap releases the lock on the way out) — in the preflight as in every later step.
# The steps themselves read nothing from it. How long a step may take is the caller's to judge
# (it reads the step lines as they come and ends the command when a step overruns: before the
# stop the watcher then ends the group). From the stop on no watcher is left, so the program
# bounds its own waits: each tmux call ends (SIGKILL) after --tool-timeout seconds, saying so
# on stderr, and a step whose tmux hung fails — the lock goes with the program.

readonly TICK=10        # seconds between two `tick` lines
readonly HELD=3         # the lock is held by someone else
readonly PREFLIGHT=10   # tmux or python failed
readonly RUNNING=5      # the job's session is running (start refused)
readonly MOVED=4        # rollback: `current` no longer points at --expect
readonly GONE=143       # the caller let go before the stop: nothing was stopped
readonly HUNG=124       # a tool did not answer within --tool-timeout (`tmux` below)
readonly NO_VENV=20 NO_INSTALL=21 MISSING=22  # venv: its creation, pip, a module missing
readonly SAY_MAX=4000   # characters of one value printed by `say`
readonly COMPLETE=.complete  # written last into a release: everything before it is on disk
readonly ARCHIVE=archive     # the folder of archived runs inside the checkpoints folder
# The pane's state line (job.py parses it): dead|status|signal|pid|created|server pid
readonly FORMAT='#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_pid}|#{session_created}|#{pid}'

say() { printf '%s\t%s\n' "$1" "${2:0:$SAY_MAX}"; }
fail() { say failed "$1"; exit 1; }

# --- lock: a symlink whose text is the owner record (`ln -sT` is atomic) --------------------

lock_take() {  # $1 root, $2 lock path, $3 owner text. 0: taken; HELD: held (stdout: record)
  local n=0
  mkdir -p -- "$1" || return 1
  while [ "$n" -lt 20 ]; do
    if ln -sT -- "$3" "$2" 2>/dev/null; then return 0; fi
    if readlink -- "$2"; then return "$HELD"; fi
    n=$((n + 1))  # it vanished between ln and readlink: try again
  done
  echo "cannot create the lock $2" >&2
  return 1
}
lock_take_over() {  # $1 lock path, $2 the stale record, $3 a token. HELD: it changed meanwhile
  # Renamed aside (atomic: of two takers only one moves it), then checked: a fresh lock moved
  # by mistake is put back.
  local aside="$1.stale.$3" moved
  mv -T -- "$1" "$aside" 2>/dev/null || return "$HELD"
  moved=$(readlink -- "$aside") || moved=""
  if [ "$moved" = "$2" ]; then rm -f -- "$aside"; return 0; fi
  ln -sT -- "$moved" "$1" 2>/dev/null
  rm -f -- "$aside"
  return "$HELD"
}
lock_release() {  # $1 lock path, $2 our record: removes the lock only if it is still ours
  if [ "$(readlink -- "$1")" = "$2" ]; then rm -f -- "$1"; fi
}
proc_start() {  # $1 a pid: "BOOT_ID START_TICKS" of that process; fails when none (or a zombie)
  local s boot
  { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1
  { read -r boot < /proc/sys/kernel/random/boot_id; } 2>/dev/null || boot=-
  s=${s##*) }
  # shellcheck disable=SC2086  # split into the stat fields (state, ppid, pgrp, ...)
  set -- $s
  [ "$1" != Z ] || return 1
  printf '%s %s\n' "$boot" "${20}"
}
lock_record() {  # $1 the operator's record (JSON), $2 our pid: the record naming us
  local start
  start=$(proc_start "$2") || return 1
  printf '%s,"place_pid":%s,"place_start":"%s"}\n' "${1%\}}" "$2" "$start"
}
lock_holder() {  # $1 a lock record: alive, gone, or unknown (no place identity in it)
  local re='"place_pid":([0-9]+),"place_start":"([^"]*)"' pid want
  [[ $1 =~ $re ]] || { echo unknown; return 0; }
  pid=${BASH_REMATCH[1]} want=${BASH_REMATCH[2]}
  if [ "$(proc_start "$pid")" = "$want" ]; then echo alive; else echo gone; fi
}

# --- releases: releases/<id>.tmp → marker → releases/<id> → `current` ------------------------

release_clean() {  # $1 root: removes what interrupted deploys left; prints each id.tmp it removed
  # Only under the lock (no unpack runs then): `releases/<id>.tmp`, named as a release id, the
  # entry itself (`rm -rf` never follows a link).
  local LC_ALL=C d name
  for d in "$1"/releases/*.tmp; do
    { [ -e "$d" ] || [ -L "$d" ]; } || continue
    name=${d##*/}
    [[ $name =~ ^[0-9]{8}-[0-9]{6}-[0-9]{3}-[0-9a-f]{4}\.tmp$ ]] || continue
    rm -rf -- "$d" || return 1
    printf '%s\n' "$name"
  done
}
release_unpack() {  # $1 root, $2 id; stdin: the bundle's tar
  # Unfinished releases of earlier, interrupted deploys (`*.tmp`) are removed first; the
  # marker is written only after tar succeeded and the files were flushed.
  local rel=$1/releases
  mkdir -p -- "$rel" || return 1
  release_clean "$1" >/dev/null || return 1
  mkdir -- "$rel/$2.tmp" || return 1
  tar -x --no-same-owner -C "$rel/$2.tmp" -f - || return 1
  sync -f -- "$rel/$2.tmp" || return 1
  : > "$rel/$2.tmp/$COMPLETE"
}
release_switch() {  # $1 root, $2 id: complete release $2, point `current` at it; list releases
  # `.tmp` is renamed away once it has its marker; `current` moves atomically (a new link
  # renamed over the old one).
  ( cd -- "$1" || exit 1
    if [ -f "releases/$2.tmp/$COMPLETE" ]; then
      mv -T -- "releases/$2.tmp" "releases/$2" || exit 1
    fi
    [ -f "releases/$2/$COMPLETE" ] || { echo "release $2 is not complete" >&2; exit 1; }
    ln -sfn -- "releases/$2" .current.tmp || exit 1
    mv -T -- .current.tmp current || exit 1
    ls -1 -- releases )
}
release_prune() {  # $1 root, $2 keep, $3 current, then release ids; prints each id it deleted
  # All but the newest $2 go, never $3 and never the newest release older than $3 (the one
  # `rollback` goes back to). Ids sort by time (LC_ALL=C: ASCII ranges and order).
  local LC_ALL=C root=$1 keep=$2 current=$3 id prev="" i
  local -a ids=()
  shift 3
  while IFS= read -r id; do
    case $id in
      [0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]-[0-9][0-9][0-9][0-9][0-9][0-9]-[0-9][0-9][0-9]-[0-9a-f][0-9a-f][0-9a-f][0-9a-f])
        ids+=("$id") ;;
    esac
  done < <(printf '%s\n' "$@" | sort -u)
  [ "$keep" -gt 0 ] || return 0
  for id in "${ids[@]}"; do [[ $id < $current ]] && prev=$id; done
  for ((i = 0; i < ${#ids[@]} - keep; i++)); do
    id=${ids[i]}
    if [ "$id" = "$current" ] || [ "$id" = "$prev" ]; then continue; fi
    rm -rf -- "$root/releases/$id" || return 1
    printf '%s\n' "$id"
  done
}

# --- checkpoints ----------------------------------------------------------------------------

checkpoints_archive() {  # $1 folder, $2 destination; prints `moved` when it moved anything
  # Every entry except `archive/` moves into $2 (created only when there is something to
  # move). Entries are the folder's own names (globs, hidden ones included).
  [ -d "$1" ] || return 0
  ( cd -- "$1" || exit 1
    dest=$2; set --
    for e in * .[!.]* ..?*; do
      { [ -e "$e" ] || [ -L "$e" ]; } || continue
      [ "$e" = "$ARCHIVE" ] || set -- "$@" "$e"
    done
    [ "$#" -gt 0 ] || exit 0
    mkdir -p -- "$dest" || exit 1
    mv -- "$@" "$dest/" || exit 1
    echo moved )
}
checkpoints_remove_run() {  # $1 checkpoints folder, $2 an archived run. Exit 3: refused
  # Proves at the place that $2 is a run: not a link, a folder named as a run, directly in
  # `archive/` strictly inside the checkpoints folder. `rm -rf` gets the entry itself, never a
  # resolved path, so a link swapped in at the last moment is removed as a link.
  local entry=$2 name=${2##*/} base arch parent
  refuse() { echo "refusing to delete $entry: $1" >&2; exit 3; }
  base=$(realpath -e -- "$1") || refuse "the checkpoints folder does not resolve"
  case "$base" in ""|/) refuse "the checkpoints folder resolves to ${base:-nothing}";; esac
  arch=$(realpath -e -- "$base/$ARCHIVE") || refuse "there is no archive folder"
  case "$arch/" in "$base"/?*/) ;; *) refuse "the archive folder resolves to $arch";; esac
  [ ! -L "$entry" ] || refuse "it is a symbolic link (to $(readlink -- "$entry")): not a run"
  [[ $name =~ ^[0-9]{8}T[0-9]{6}\.[0-9]{3}Z$ ]] || refuse "it is not a run (archive/<UTC time>)"
  parent=$(realpath -e -- "${entry%/*}/") || refuse "its folder does not resolve"
  [ "$parent" = "$arch" ] || refuse "it is not directly inside $arch/"
  { [ -d "$arch/$name" ] && [ ! -L "$arch/$name" ]; } || refuse "it is not a run folder"
  rm -rf -- "${arch:?}/$name"
}

# --- job: one tmux session on a private socket ----------------------------------------------

tmux() {  # the real tmux; from the stop on (`hold_on` sets tool_bound) SIGKILLed after
  # --tool-timeout seconds (HUNG, said on stderr). --foreground keeps it in our process group.
  local rc
  [ -n "$tool_bound" ] || { command tmux "$@"; return; }
  timeout --foreground -s KILL "$tool_bound" tmux "$@"; rc=$?
  [ "$rc" = 137 ] || return "$rc"
  echo "\`tmux ${3:-$1}\` did not answer within $tool_bound s" >&2
  return "$HUNG"
}
have_tmux() {
  type -P tmux >/dev/null || { echo "tmux: command not found" >&2; return 1; }
}
job_read() {  # $1 socket, $2 session: the pane's state line; nothing without a session
  # Exit 2: tmux failed otherwise (three times), its error on stderr — never taken for "no
  # session", which would let a stop skip a live job.
  local out rc n=0
  while :; do
    out=$(tmux -L "$1" list-panes -t "=$2:" -F "$FORMAT" 2>&1 | head -c 4096
          exit "${PIPESTATUS[0]}"); rc=$?
    [ "$rc" != 0 ] || { printf '%s\n' "${out%%$'\n'*}"; return 0; }
    [ "$rc" != "$HUNG" ] || { printf '%s\n' "${out##*$'\n'}" >&2; return 2; }
    case $out in
      *"can't find session"* | *"can't find window"* | *"no server running"* | \
      *"error connecting to"*"(No such file or directory)"* | \
      *"error connecting to"*"(Connection refused)"*) return 0 ;;
    esac
    n=$((n + 1))
    [ "$n" -lt 3 ] || { printf 'tmux: %s\n' "${out%%$'\n'*}" >&2; return 2; }
    sleep 0.2
  done
}
job_ended() {  # $1 a state line: 0 when the job has ended (tmux has its status)
  # The status is there once tmux has reaped the pane's process, even while the pane still
  # looks alive (a process of the job that left its group holds its terminal open).
  local status signal rest
  IFS='|' read -r _ status signal rest <<< "$1"
  [ -n "$status$signal" ]
}
job_state() {  # $1 socket, $2 session: the state line, once tmux has a status to show
  local line n=0
  line=$(job_read "$1" "$2") || return $?
  # tmux 3.3 sometimes misses the SIGCHLD of a pane process (the pane is dead but has no
  # status); another SIGCHLD makes it reap the process and record the status.
  while [ "${line%%|*}" = 1 ] && ! job_ended "$line" && [ "$n" -lt 10 ]; do
    [ "$n" != 0 ] || job_nudge "$line"
    sleep 0.02; n=$((n + 1))
    line=$(job_read "$1" "$2") || return $?
  done
  [ -z "$line" ] || printf '%s\n' "$line"
}
job_nudge() {  # $1 a state line: SIGCHLD to its tmux server, which then reaps what it missed
  local server rest
  IFS='|' read -r _ rest rest rest rest server <<< "$1"
  [ -z "$server" ] || kill -s CHLD "$server" 2>/dev/null
}
group_alive() {  # $1 a process group: 0 while a live member is left (zombies are dead)
  # /proc is scanned with the `read` builtin: a `cat` per process costs a fork each, seconds
  # on a busy machine with a few hundred processes.
  local f s pg=$1
  for f in /proc/[0-9]*/stat; do
    { read -r s < "$f"; } 2>/dev/null || continue; s=${s##*) }
    # shellcheck disable=SC2086  # split into the stat fields (state, ppid, pgrp, ...)
    set -- $s; [ "$1" != Z ] && [ "$3" = "$pg" ] && return 0
  done
  return 1
}
signal_and_wait() {  # $1 signal, $2 process group, $3 ticks of 0.1 s. 1: still alive
  # Looks every 0.02 s: most jobs are gone a few ms after the signal.
  local n=0
  kill -s "$1" -- "-$2" 2>/dev/null || return 0
  while group_alive "$2"; do
    [ "$n" -ge $(($3 * 5)) ] && return 1
    sleep 0.02; n=$((n + 1))
  done
}
job_key() {  # $1 a state line: the session's identity, `PANE_PID.CREATED`
  local pid created rest
  IFS='|' read -r _ _ _ pid created rest <<< "$1"
  printf '%s.%s\n' "$pid" "$created"
}
job_end() {  # $1 socket, $2 session, $3 its key: ends the session only if it is still it
  # tmux checks the key and kills in one step of its server: a session started under the same
  # name since the key was read (by a later command) is never touched. Session ids alone are
  # not enough: a new server numbers its sessions from $0 again. The session is read again
  # afterwards: a kill that did not happen (tmux busy, its client refused) is tried again, and
  # said (exit 1) rather than leaving the next start to find the session still there.
  local line n=0
  while :; do
    tmux -L "$1" if-shell -F -t "=$2:" "#{==:#{pane_pid}.#{session_created},$3}" \
      "kill-session -t =$2" >/dev/null 2>&1
    line=$(job_read "$1" "$2") || return $?
    { [ -n "$line" ] && [ "$(job_key "$line")" = "$3" ]; } || return 0
    n=$((n + 1))
    [ "$n" -lt 5 ] || { echo "tmux did not close the job session $2" >&2; return 1; }
    sleep 0.1
  done
}
job_stop() {  # $1 socket, $2 session, $3 "INT,TERM,KILL" ticks of 0.1 s after each signal
  # Prints the job's last state line (nothing when there was no session), after `survived
  # PID` when its process group outlived SIGKILL, and ends the session — the one read here,
  # never another that took its name meanwhile (`job_end`).
  local line pid rest sig ticks key n=0 int term kill
  IFS=, read -r int term kill <<< "$3"
  have_tmux || return 127
  line=$(job_state "$1" "$2") || return $?
  [ -n "$line" ] || return 0
  IFS='|' read -r _ _ _ pid rest <<< "$line"
  key=$(job_key "$line")
  if ! job_ended "$line" && [ -n "$pid" ]; then
    for sig in INT TERM KILL; do
      case $sig in INT) ticks=$int ;; TERM) ticks=$term ;; *) ticks=$kill ;; esac
      signal_and_wait "$sig" "$pid" "$ticks" && break
    done
    # tmux reaps the pane asynchronously (tmux 3.3 now and then only after a nudge): 1 s at most
    line=$(job_state "$1" "$2") || return $?
    while ! job_ended "$line" && [ "$n" -lt 20 ]; do
      [ "$(job_key "$line")" = "$key" ] || break  # another session by now
      job_nudge "$line"
      sleep 0.05; n=$((n + 1)); line=$(job_read "$1" "$2") || return $?
    done
    # Still alive after SIGKILL: a process of its group that no signal reaches (in the
    # kernel: a hung disk or driver). Said, for the caller to report.
    if group_alive "$pid"; then printf 'survived %s\n' "$pid"; fi
  fi
  job_end "$1" "$2" "$key" || return $?
  printf '%s\n' "$line"
}
tmux_start() {  # $1 socket, then tmux's start arguments: its output (bounded) and status
  tmux -L "$@" 2>&1 | head -c 4096
  return "${PIPESTATUS[0]}"
}
job_start() {  # $1 socket, $2 session, $3 the log's folder, then tmux's start arguments
  # Prints the new pane's state line. Exit RUNNING: the job is running. A dead session left
  # by an earlier run is removed first.
  local sock=$1 sess=$2 line out rc pid rest
  have_tmux || return 127
  line=$(job_state "$sock" "$sess") || return $?
  if [ -n "$line" ]; then
    # Running only while its process group has a live member: tmux may not have reaped a job
    # just stopped (or see its terminal held open by a process that left the group).
    IFS='|' read -r _ _ _ pid rest <<< "$line"
    if ! job_ended "$line" && [ -n "$pid" ] && group_alive "$pid"; then
      echo "the job session $sess is running (pid $pid)" >&2; return "$RUNNING"
    fi
    job_end "$sock" "$sess" "$(job_key "$line")" || return $?
  fi
  mkdir -p -- "$3" || return 125
  shift 3
  out=$(tmux_start "$sock" "$@"); rc=$?
  if [ "$rc" != 0 ] && ! tmux -L "$sock" has-session -t "=$sess" 2>/dev/null; then
    case $out in  # the server of a session just killed was still exiting, and took this one
      *"no current target"* | *"server exited"* | *"lost server"*)
        sleep 0.3; out=$(tmux_start "$sock" "$@"); rc=$? ;;
    esac
  fi
  [ "$rc" = 0 ] || { printf '%s\n' "$out" >&2; return "$rc"; }
  line=${out%%$'\n'*}
  if [ "${line%%|*}" = 1 ] && ! job_ended "$line"; then
    line=$(job_state "$sock" "$sess")
  fi
  printf '%s\n' "$line"
}

# --- the job's venv: built once per requirements, from the target's python -----------------

venv_check() {  # the venv's python finds every module of the trainer (--probe: one python -c)
  local out rc
  out=$("${probe[@]}" </dev/null); rc=$?
  printf '%s\n' "${out##*$'\n'}"
  return "$rc"
}
venv_build() {  # --venv DIR from --python BASE: exit 0 when it is complete, now or before
  # Another build of the same folder is waited for (flock on DIR.lock); a folder without its
  # marker is an interrupted build, removed first. Exit NO_VENV, NO_INSTALL, MISSING: the step.
  local dir=$venv
  local -a pip
  if [ -f "$dir/$COMPLETE" ]; then
    venv_check || return "$MISSING"; echo "dflash: $dir is built already"; return 0
  fi
  mkdir -p -- "${dir%/*}" || return 1
  exec 9>"$dir.lock" || return 1
  if command -v flock >/dev/null; then flock 9 || return 1; fi
  if [ -f "$dir/$COMPLETE" ]; then
    venv_check || return "$MISSING"; echo "dflash: $dir is built already"; return 0
  fi
  rm -rf -- "$dir" || return 1
  echo "dflash: creating $dir from $base"
  if [ -n "$system_site" ]; then
    "$base" -m venv --system-site-packages -- "$dir" </dev/null || return "$NO_VENV"
  else
    "$base" -m venv -- "$dir" </dev/null || return "$NO_VENV"
  fi
  printf '%s' "$requirements" > "$dir/requirements.txt" || return 1
  pip=("$dir/bin/python" -m pip install --disable-pip-version-check --no-input --progress-bar off)
  [ -z "$wheels" ] || pip+=(--no-index --find-links "$wheels")
  if [ -n "$torch_index" ]; then
    echo "dflash: installing $torch from $torch_index"
    "${pip[@]}" --index-url "$torch_index" "$torch" </dev/null || return "$NO_INSTALL"
  fi
  echo "dflash: installing $dir/requirements.txt"
  "${pip[@]}" -r "$dir/requirements.txt" </dev/null || return "$NO_INSTALL"
  venv_check || return "$MISSING"
  : > "$dir/$COMPLETE" || return 1
  echo "dflash: built $dir"
}

# --- the commands ---------------------------------------------------------------------------

watch_caller() {  # $1 our process group, $2 the bundle's file ("": none), $3 its size
  # Started first, the only reader of the caller's stdin (fd 3): the bundle (exactly its size,
  # saved to $2 for the unpack step, whole or not at all), then nothing, held open by the
  # caller until we exit. EOF before that means the caller or its connection is gone, and
  # nothing may be done in its name any more: TERM to our group (the EXIT trap releases the
  # lock), then, once the steps' shell is gone (3 s at most), KILL to what is left of it.
  { local n=0
    if [ -n "$2" ] && head -c "$3" > "$2.part" && [ "$(wc -c < "$2.part")" -eq "$3" ]; then
      mv -- "$2.part" "$2"
    fi
    cat >/dev/null; trap '' TERM; kill -s TERM -- "-$1"
    while kill -0 "$1" 2>/dev/null && [ "$n" -lt 30 ]; do sleep 0.1; n=$((n + 1)); done
    [ -z "$scratch" ] || rm -rf -- "$scratch"
    kill -s KILL -- "-$1"
  } <&3 >/dev/null 2>&1 &
  watcher=$!
}

hold_on() {  # the point of no return, as the stop begins: from here on the steps go to the end
  # Signals are handled (not ignored: what is started after gets their default again) and the
  # caller's watcher goes; a caller that let go before this moment (its end of stdin closed:
  # `read -t 0` on fd 3 finds EOF, the watcher having taken every byte before it) still leaves
  # everything as it was.
  trap ':' TERM HUP INT PIPE
  if [ -n "$tool_timeout" ] && timeout --foreground 1 true 2>/dev/null; then
    tool_bound=$tool_timeout  # no watcher from here: the program bounds its own tmux calls
  fi
  if [ -n "$watcher" ]; then kill -s KILL "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null; fi
  watcher=""
  if read -r -t 0 <&3; then exit "$GONE"; fi
}

ticks() {  # in the background: `tick<TAB>SECONDS` every TICK s, as long as the program runs
  local s=0
  while sleep "$TICK"; do s=$((s + TICK)); say tick "$s" || return 0; done
}
ticks_stop() { kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null; }

usage() { echo "site.sh: $1" >&2; exit 2; }

parse_options() {  # named options into the globals below; after `--`: tmux's start arguments
  root="" id="" size="" keep=5 lock="" owner="" stale="" ckpt="" dest="" expect=""
  socket="" session="" log="" ticks="" run="" wait=0 ready="" watcher="" tool_timeout=""
  tool_bound=""
  venv="" base="" requirements="" torch_index="" torch="" wheels="" system_site=""
  probe=() checker=() tmux_args=()
  while [ "$#" -gt 0 ]; do
    case $1 in
      --) shift; tmux_args=("$@"); return 0 ;;
      --*) [ "$#" -ge 2 ] || usage "$1 needs a value" ;;
      *) usage "unexpected argument $1" ;;
    esac
    case $1 in
      --root) root=$2 ;;
      --release) id=$2 ;;
      --bundle-size) size=$2 ;;
      --keep) keep=$2 ;;
      --lock) lock=$2 ;;
      --owner) owner=$2 ;;
      --stale) stale=$2 ;;
      --checkpoints) ckpt=$2 ;;
      --archive-to) dest=$2 ;;
      --expect) expect=$2 ;;
      --probe) probe+=("$2") ;;
      --check) checker+=("$2") ;;
      --socket) socket=$2 ;;
      --session) session=$2 ;;
      --log) log=$2 ;;
      --stop-ticks) ticks=$2 ;;
      --run) run=$2 ;;
      --wait) wait=$2 ;;
      --venv) venv=$2 ;;
      --python) base=$2 ;;
      --requirements) requirements=$2 ;;
      --torch-index) torch_index=$2 ;;
      --torch) torch=$2 ;;
      --wheels) wheels=$2 ;;
      --system-site) system_site=$2 ;;
      --ready) ready=$2 ;;
      --tool-timeout) tool_timeout=$2 ;;
      *) usage "unknown option $1" ;;
    esac
    shift 2
  done
}

step_preflight() {  # tmux, then the job's python answering the probe (their output bounded)
  local out rc
  say step tmux
  if have_tmux; then out=$(tmux -V | head -c 4096; exit "${PIPESTATUS[0]}"); rc=$?
  else out="" rc=127; fi
  say tmux "$rc ${out%%$'\n'*}"
  [ "$rc" = 0 ] || exit "$PREFLIGHT"
  say step python
  out=$("${probe[@]}" | tail -c 4096; exit "${PIPESTATUS[0]}"); rc=$?
  say python "$rc ${out##*$'\n'}"
  [ "$rc" = 0 ] || exit "$PREFLIGHT"
}

step_lock() {  # takes the lock (over the judged stale record); from here EXIT releases it
  local held rc
  say step lock
  record=$(lock_record "$owner" "$me") || fail 1
  if [ -n "$stale" ]; then lock_take_over "$lock" "$stale" "$me"; fi
  held=$(lock_take "$root" "$lock" "$record"); rc=$?
  if [ "$rc" = "$HELD" ]; then
    ticks_stop  # `held` is the last line: the record is all that follows it
    say holder "$(lock_holder "$held")"
    say held "$held"
    exit "$HELD"
  fi
  [ "$rc" = 0 ] || fail "$rc"
  trap 'lock_release "$lock" "$record"; leave' EXIT
}

step_unpack_and_check() {  # the bundle into releases/<id>.tmp, then the trainer's own check
  local out rc l
  say step unpack
  # The watcher saves the bundle as it arrives (with the preflight): here it is mostly there.
  while [ ! -f "$scratch/bundle" ]; do sleep 0.05; done
  release_unpack "$root" "$id" < "$scratch/bundle" || fail $?
  if [ "${#checker[@]}" -gt 0 ] && [ -f "$root/releases/$id.tmp/trainer/commands/check.py" ]; then
    say step check
    out=$(cd -- "$root/releases/$id.tmp" && "${checker[@]}" 2>&1 | tail -c 65536
          exit "${PIPESTATUS[0]}"); rc=$?
    if [ "$rc" != 0 ]; then
      rm -rf -- "$root/releases/$id.tmp"
      while IFS= read -r l; do say check "$l"; done <<< "$out"
      fail "$rc"
    fi
  fi
}

step_expect() {  # rollback: `current` must still be --expect (its target was chosen from it)
  local now
  [ -n "$expect" ] || return 0
  say step expect
  now=$(readlink -- "$root/current")
  if [ "$now" != "releases/$expect" ]; then
    say moved "${now##*/}"
    fail "$MOVED"
  fi
}

step_switch() {  # `current` → releases/<id>
  say step switch
  names=$(release_switch "$root" "$id") || fail $?
}

step_prune() {  # keep the last --keep releases
  local removed r
  say step prune
  mapfile -t names <<< "$names"
  removed=$(release_prune "$root" "$keep" "$id" "${names[@]}") || fail $?
  while IFS= read -r r; do [ -z "$r" ] || say removed "$r"; done <<< "$removed"
}

step_current() {  # restart: the release `current` points at
  local current
  say step current
  current=$(readlink -- "$root/current") || fail $?
  say current "${current##*/}"
}

step_clean() {  # restart, rollback: what killed deploys left in releases/ (under the lock)
  local cleaned c
  say step clean
  cleaned=$(release_clean "$root") || fail $?
  while IFS= read -r c; do [ -z "$c" ] || say cleaned "$c"; done <<< "$cleaned"
}

step_stop() {  # the point of no return (`hold_on`)
  local out l
  hold_on
  say step stop
  out=$(job_stop "$socket" "$session" "$ticks") || fail $?
  while IFS= read -r l; do
    case $l in
      "survived "*) say survived "${l#survived }" ;;
      ?*) say stopped "$l" ;;
    esac
  done <<< "$out"
}

step_archive() {  # the checkpoints into --archive-to
  local out
  [ -n "$dest" ] || return 0
  say step archive
  out=$(checkpoints_archive "$ckpt" "$dest") || fail $?
  [ "$out" != moved ] || say archived "$dest"
}

step_start() {  # `logged`: the log's size before the job starts (its output begins there)
  local dir=${log%/*}
  say step start
  logged=$(stat -c %s -- "$log" 2>/dev/null) || logged=0
  say logged "$logged"
  started=$(job_start "$socket" "$session" "${dir:-/}" "${tmux_args[@]}") || fail $?
  say started "$started"
}

step_ready() {  # until the job is past start-up: `startup ready|starting|interrupted`, or
  # `ended STATE-LINE` after its log's last lines (`tail LINE`, 20 of them, 500 bytes each)
  local n=0 dead rest pid from=$((logged + 1)) line
  [ "$wait" -gt 0 ] || return 0
  say step ready
  lock_release "$lock" "$record"  # the job has started: nothing here changes any more
  IFS='|' read -r dead rest rest pid rest <<< "$started"
  while :; do
    if tail -c "+$from" -- "$log" 2>/dev/null | grep -qF -- "$ready"; then
      say startup ready; return 0
    fi
    if [ "$dead" = 1 ] || ! proc_start "$pid" >/dev/null; then
      while IFS= read -r line; do say tail "$line"; done < <(tail -n 20 -- "$log" | cut -b 1-500)
      say ended "$(job_state "$socket" "$session")"; return 0
    fi
    [ "$n" -lt "$wait" ] || { say startup starting; return 0; }
    if read -r -t 0 <&3; then say startup interrupted; return 0; fi  # the caller let go
    sleep 0.1; n=$((n + 1))
  done
}

leave() {  # the end of the steps: the bundle's copy goes, and nothing we started outlives us
  [ -z "$scratch" ] || rm -rf -- "$scratch"
  trap "" TERM; kill -s TERM -- "-$me"
}

site_main() {  # $1 the command, then its options; fd 3: the caller's stdin
  local command=$1
  shift
  parse_options "$@"
  me=$BASHPID scratch=""
  trap 'exit 143' TERM HUP INT
  trap leave EXIT
  if [ "$command" = deploy ]; then
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/dflash-deploy.XXXXXX") || fail 1
    watch_caller "$me" "$scratch/bundle" "$size"
  else
    watch_caller "$me" "" 0
  fi
  ticks & ticker=$!
  if [ "$command" = deploy ] && [ "${#probe[@]}" -gt 0 ]; then step_preflight; fi
  step_lock
  case $command in
    deploy) step_unpack_and_check ;;
    rollback) step_expect; step_clean ;;
    restart) step_current; step_clean ;;
  esac
  step_stop
  case $command in
    deploy) step_switch; step_prune; step_archive ;;
    rollback) step_switch ;;
    restart) step_archive ;;
  esac
  if [ "$command" != stop ]; then step_start; step_ready; fi
  say step 'done'
}

case ${1:-} in
  deploy | restart | rollback | stop)
    # The steps run as a job of their own (job control: their own process group), which
    # `watch_caller` can end whole; this shell only waits for it and passes its status on.
    # Job control goes off once the group exists, so bash prints no "[1]+ Exit N" notice.
    # Its stdin is /dev/null: the caller's (fd 3) is the watcher's alone.
    set -m
    site_main "$@" 3<&0 </dev/null &
    main=$!
    set +m
    wait "$main"
    ;;
  prune-run)
    parse_options "${@:2}"
    checkpoints_remove_run "$ckpt" "$run"
    ;;
  venv)
    parse_options "${@:2}"
    venv_build
    ;;
  *) usage "unknown command ${1:-(none)}: deploy, restart, rollback, stop, prune-run or venv" ;;
esac

#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, from Debian's packages, for the kit's SLURM tests (make test-slurm):
# munged, MariaDB + slurmdbd (so sacct has every job, running or finished), slurmctld and slurmd, each started as a
# plain daemon (no systemd), with a minimal slurm.conf (no cgroups: proctrack/linuxproc, task/none).
#
#     .ci/slurm-cluster.sh start     # install what is missing (root + apt), start; prints SLURM_CONF=<state>/slurm.conf
#     .ci/slurm-cluster.sh stop      # cancel the cluster's jobs, stop the daemons this script started (by their pid
#                                    # files); the state is kept
#     .ci/slurm-cluster.sh status    # exit 0 when the cluster answers
#
# Everything lives in $SLURM_STATE (default /tmp/dpo-kit-slurm): configs, its own munge key and socket, the database,
# spool, logs. Nothing under /etc is written: clients find the cluster through SLURM_CONF. Non-default ports
# (16817-16819, MariaDB 16306), so a real SLURM or MySQL on the machine is left alone. start is idempotent (a running
# cluster is reused). Exit 77 when SLURM cannot be set up or started here, saying why.
set -euo pipefail

STATE=${SLURM_STATE:-/tmp/dpo-kit-slurm}
CONF=$STATE/slurm.conf
SOCK=$STATE/munge/munge.socket
DB_PORT=16306
T0=$SECONDS
say() { echo "[slurm-cluster $((SECONDS - T0))s] $*"; }
skip() { echo "[slurm-cluster] SLURM cannot start here: $*" >&2; exit 77; }
alive() { [[ -f $STATE/$1.pid ]] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }
answers() { SLURM_CONF=$CONF timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local limit=$1 what=$2 deadline=$((SECONDS + $1)); shift 2
  until "$@"; do ((SECONDS < deadline)) || skip "$what did not come up in ${limit}s (logs in $STATE/log/)"; sleep 0.25; done
}

daemon() {  # daemon NAME COMMAND...: start it (it forks); when it fails, say why from its stderr or its log
  local name=$1; shift
  "$@" 2>"$STATE/log/$name.stderr" && return 0
  skip "$name did not start: $(cat "$STATE/log/$name.stderr" "$STATE/log/$name.log" 2>/dev/null | grep -v '^$' | tail -2 | tr '\n' ' ')"
}

install() {
  local need=()
  for pair in munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client slurmdbd:slurmdbd \
              mariadbd:mariadb-server; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
  done
  ((${#need[@]})) || return 0
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || skip "needs ${need[*]}, and installing them needs root and apt-get"
  say "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; }; } \
    || skip "apt-get install ${need[*]} failed"
}

configure() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p "$STATE"/{munge,log,ctld,spool,mysql-run}  # slurmdbd reads slurmdbd.conf beside SLURM_CONF
  chmod 755 "$STATE" "$STATE/munge"  # munged: its socket directory must be searchable by all
  cat > "$CONF" <<EOF
# dpo-kit's one-node test cluster (.ci/slurm-cluster.sh); clients: SLURM_CONF=$CONF
ClusterName=dpokit
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No cgroups here: processes are tracked by parent pid, tasks are not confined
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# A cancelled or preempted training gets SIGTERM, then this long to save its checkpoint before SIGKILL
KillWait=120
MinJobAge=60
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=16819
# the munge socket for slurmdbd connections (AuthInfo covers the rest)
AccountingStoragePass=$SOCK
JobCompType=jobcomp/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat > "$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=16819
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$STATE/slurmdbd.conf"
  [[ -f $STATE/munge.key ]] || mungekey --create --keyfile="$STATE/munge.key" >/dev/null 2>&1 \
    || dd if=/dev/urandom of="$STATE/munge.key" bs=1024 count=1 status=none
  chmod 400 "$STATE/munge.key"
}

start_munge() {
  alive munged && return 0
  say "munged"
  daemon munged munged --force --socket="$SOCK" --key-file="$STATE/munge.key" --pid-file="$STATE/munged.pid" \
    --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munge.seed"
  wait_for 10 munged munge --socket="$SOCK" -n -o /dev/null
}

start_db() {
  alive mariadb && return 0
  say "MariaDB (its own data directory and port $DB_PORT)"
  if [[ ! -d $STATE/mysql/mysql ]]; then
    mariadb-install-db --no-defaults --datadir="$STATE/mysql" --user=root --auth-root-authentication-method=normal \
      --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || skip "mariadb-install-db failed ($STATE/log/mariadb-install.log)"
  fi
  mariadbd --no-defaults --datadir="$STATE/mysql" --user=root --bind-address=127.0.0.1 --port=$DB_PORT \
    --socket="$STATE/mysql-run/mysqld.sock" --pid-file="$STATE/mariadb.pid" --skip-name-resolve \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 --log-error="$STATE/log/mariadb.log" >/dev/null 2>&1 &
  disown
  wait_for 60 MariaDB mariadb --no-defaults -S "$STATE/mysql-run/mysqld.sock" -u root -e 'select 1' >/dev/null 2>&1
  mariadb --no-defaults -S "$STATE/mysql-run/mysqld.sock" -u root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' \
    IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
}

start_slurm() {
  if ! alive slurmdbd; then
    say "slurmdbd"
    SLURM_CONF=$CONF daemon slurmdbd slurmdbd
    wait_for 30 slurmdbd bash -c "SLURM_CONF=$CONF timeout 5 sacctmgr -n -P show cluster >/dev/null 2>&1"
    SLURM_CONF=$CONF sacctmgr -i add cluster dpokit >/dev/null 2>&1 || true
  fi
  if ! alive slurmctld; then
    say "slurmctld"
    daemon slurmctld slurmctld -f "$CONF"
  fi
  if ! alive slurmd; then
    say "slurmd"
    daemon slurmd slurmd -f "$CONF"
  fi
  wait_for 60 "the node (sinfo: idle)" answers
}

stop() {
  if alive slurmctld; then  # every job here is the tests': none is left running without its daemons
    SLURM_CONF=$CONF timeout 10 scancel --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 60); do [[ -z $(SLURM_CONF=$CONF timeout 10 squeue -h 2>/dev/null) ]] && break; sleep 0.5; done
  fi
  for d in slurmd slurmctld slurmdbd mariadb munged; do
    if alive $d; then say "stopping $d"; kill "$(cat "$STATE/$d.pid")"; fi
  done
  for d in slurmd slurmctld slurmdbd mariadb munged; do
    for _ in $(seq 40); do alive $d || break; sleep 0.25; done
  done
}

case ${1:-start} in
  start)
    if alive slurmctld && answers; then echo "SLURM_CONF=$CONF"; exit 0; fi
    install
    configure
    start_munge
    start_db
    start_slurm
    say "up: $(SLURM_CONF=$CONF sinfo -h -o '%P %D node(s) %c CPUs %T')"
    echo "SLURM_CONF=$CONF"
    ;;
  stop) stop ;;
  status) alive slurmctld && answers ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac

// One desktop client: the socket (with backoff, hello and replay), pull-lease or push-lease, running tasks through their phases
// with extend, yielding at safe points on an interrupt, results, and heartbeats with platform health.
// docs/desktop-protocol.md describes the protocol this implements.

import { EventEmitter } from 'node:events';
import WebSocket from 'ws';

import type {
  ErrorBody, ErrorEvent, Heartbeat, Hello, LeasedTask, ResultRequest, TaskAvailable, TaskControl,
} from './generated/protocol.js';
import { SUPPORTED_MAJORS } from './generated/protocol.js';
import { HubHttp, HubHttpError, sleep } from './http.js';
import {
  DEFAULT_BACKOFF, NOT_STARTED, PREEMPT_REASON, SAFE_POINT_BEFORE, STOP_CLOSE_CODES, acceptsGeneration, backoffDelay, drainDelayMs,
  leaseTokenEpoch, yieldsAt, type BackoffOptions, type ExecutionPhase,
} from './rules.js';

export const SUBPROTOCOL_PREFIX = 'monitor.desktop.v';
/** The upgrade header naming the capabilities a client asks for, and push-lease's (docs/desktop-protocol.md). */
export const CAPABILITIES_HEADER = 'X-Monitor-Capabilities';
export const PUSH_LEASE = 'push_lease';

/** The lease a `task_available` carries (push-lease), as a lease call would have answered it; null: lease by pull. */
export function pushedLease(event: TaskAvailable): LeasedTask | null {
  const { lease_token, lease_epoch, lease_expires_at, brand, question, platform } = event;
  if (!lease_token || !lease_epoch || !lease_expires_at || !brand || !question || !platform
      || event.monitor_task_id == null || !event.business_date || event.lane === 'urgent') return null;
  return {
    task_id: event.task_id, monitor_task_id: event.monitor_task_id, lane: event.lane, priority: event.priority,
    lease_token, lease_expires_at, lease_epoch, interrupt_generation: event.interrupt_generation ?? 0,
    business_date: event.business_date, brand, question, platform, interrupt_requested: false,
    execution_owner: 'desktop_tasks',
  };
}
export type PlatformHealth = NonNullable<Heartbeat['platform_health']>;

/** What an executor answers for a task it ran to the end. */
export type TaskOutcome = Omit<ResultRequest, 'lease_token' | 'started_at' | 'finished_at'>;

/** Why the SDK stopped a task before its executor finished. */
export type EndReason = 'yielded' | 'cancelled' | 'lease_revoked' | 'fenced' | 'stopped';

export interface TaskContext {
  readonly task: LeasedTask;
  /** Aborted when the task must stop now (yielded, ended by the server, fenced, client stopping); `reason` says why. */
  readonly signal: AbortSignal;
  readonly phase: ExecutionPhase;
  readonly interruptRequested: boolean;
  /** At the end of a phase, before `next`: yields here when an interrupt is pending and `next` is a safe point
   * (answers false: stop), else reports the phase with an extend (answers true: go on). */
  checkpoint(next: ExecutionPhase): Promise<boolean>;
}

export type Executor = (context: TaskContext) => Promise<TaskOutcome>;

export interface DesktopClientOptions {
  /** The hub's base URL, http(s)://host:port; the socket is its /api/desktop/ws. */
  hubUrl: string;
  token: string;
  execute: Executor;
  maxConcurrent?: number;
  /** The client's current view of its platform logins, sent with every heartbeat. */
  platformHealth?: () => PlatformHealth;
  backoff?: BackoffOptions;
  /** The majors offered as subprotocols, most preferred first (default: those this SDK was generated for). */
  protocolMajors?: readonly number[];
  /** Ask for push-lease on the upgrade (default true): a hub that grants it sends executions already leased on
   * `task_available` (docs/desktop-protocol.md "Push-lease"), which start without a lease call. */
  pushLease?: boolean;
  /** A slow safety net: lease when idle this often even without a task_available (0: never). */
  idlePollMs?: number;
  random?: () => number;
}

export interface Refusal {
  reason: string;
  status?: number;
  code?: number;
  body?: ErrorBody;
}

interface ActiveTask {
  task: LeasedTask;
  phase: ExecutionPhase;
  generation: number;
  interruptRequested: boolean;
  controller: AbortController;
  ended: EndReason | null;
  lastSafePointAt: number;
  startedAt: Date;
  traceparent?: string;
  keepAlive?: NodeJS.Timeout;
}

type SocketOutcome =
  | { kind: 'closed'; code: number; greeted: boolean; reason?: string }
  | { kind: 'refused'; status: number; body: ErrorBody | null; retryAfterS: number | null };

export interface DesktopClient {
  on(event: 'hello', listener: (hello: Hello, subprotocol: string) => void): this;
  on(event: 'taskAvailable', listener: (event: TaskAvailable) => void): this;
  on(event: 'taskControl', listener: (event: TaskControl) => void): this;
  on(event: 'serverError', listener: (event: ErrorEvent) => void): this;
  on(event: 'leased', listener: (task: LeasedTask) => void): this;
  on(event: 'phase', listener: (task: LeasedTask, phase: ExecutionPhase) => void): this;
  on(event: 'yielded', listener: (task: LeasedTask, generation: number, phase: ExecutionPhase) => void): this;
  on(event: 'ended', listener: (task: LeasedTask, reason: EndReason) => void): this;
  on(event: 'result', listener: (task: LeasedTask, outcome: TaskOutcome, resultId: string | null) => void): this;
  on(event: 'disconnected', listener: (outcome: SocketOutcome) => void): this;
  on(event: 'refused', listener: (refusal: Refusal) => void): this;
  on(event: 'failure', listener: (error: unknown) => void): this;
}

export class DesktopClient extends EventEmitter {
  readonly http: HubHttp;
  clientId: string | null = null;
  /** The client's interrupt generation as the last hello said, raised by every event seen since. */
  interruptGeneration = 0;
  hello: Hello | null = null;
  subprotocol = '';
  refusal: Refusal | null = null;
  connects = 0;
  /** Tasks started from a pushed lease (no lease call). */
  pushedLeases = 0;

  private readonly options: Required<Omit<DesktopClientOptions, 'platformHealth'>> &
    Pick<DesktopClientOptions, 'platformHealth'>;
  private readonly active = new Map<string, ActiveTask>();
  private readonly known = new Map<string, TaskAvailable>();
  private readonly generations = new Map<string, number>();
  private readonly stopping = new AbortController();
  private socket: WebSocket | null = null;
  private loop: Promise<void> | null = null;
  private pumping: Promise<void> | null = null;
  private pumpAgain = false;
  private heartbeatTimer: NodeJS.Timeout | null = null;
  private idleTimer: NodeJS.Timeout | null = null;
  private readonly running = new Set<Promise<void>>();

  constructor(options: DesktopClientOptions) {
    super();
    this.options = {
      maxConcurrent: 1, backoff: DEFAULT_BACKOFF, protocolMajors: [...SUPPORTED_MAJORS].reverse(), idlePollMs: 5000,
      pushLease: true,
      random: Math.random, ...options,
    };
    this.http = new HubHttp({ baseUrl: options.hubUrl, token: options.token, backoff: this.options.backoff,
                              attempts: 4, random: this.options.random });
  }

  get activeTasks(): LeasedTask[] {
    return [...this.active.values()].map((a) => a.task);
  }

  phaseOf(taskId: string): ExecutionPhase | null {
    return this.active.get(taskId)?.phase ?? null;
  }

  start(): void {
    this.loop ??= this.connectionLoop();
    if (this.options.idlePollMs > 0) {
      this.idleTimer = setInterval(() => { if (this.active.size === 0 && this.hello) this.pump(); },
                                   this.options.idlePollMs);
    }
  }

  /** Close the socket and stop every task (their leases expire on the hub, or a new client process resumes). */
  async stop(): Promise<void> {
    this.stopping.abort();
    if (this.idleTimer) clearInterval(this.idleTimer);
    this.stopHeartbeats();
    for (const active of this.active.values()) this.end(active, 'stopped');
    this.socket?.close(1000, 'client stopping');
    await this.loop;
    await this.pumping;
    await Promise.allSettled([...this.running]);
    this.http.close();
  }

  // ---- the socket ---------------------------------------------------------------------------------------------
  private async connectionLoop(): Promise<void> {
    let attempt = 0;
    while (!this.stopping.signal.aborted) {
      let outcome: SocketOutcome;
      try {
        outcome = await this.connectOnce();
      } catch (error) {
        this.emit('failure', error);
        outcome = { kind: 'closed', code: 1006, greeted: false };
      }
      this.emit('disconnected', outcome);
      if (this.stopping.signal.aborted) return;
      let delayMs: number;
      if (outcome.kind === 'refused') {
        const error = outcome.body?.error ?? '';
        if (outcome.status === 401 || (outcome.status === 400 && error === 'unsupported_protocol_version')) {
          return this.refuse({ reason: error || 'unauthorized', status: outcome.status, body: outcome.body ?? undefined });
        }
        delayMs = outcome.retryAfterS !== null ? outcome.retryAfterS * 1000 : backoffDelay(attempt++, this.options.backoff, this.options.random);
      } else {
        const stop = STOP_CLOSE_CODES.get(outcome.code);
        if (stop) return this.refuse({ reason: stop, code: outcome.code });
        if (outcome.greeted) attempt = 0;  // a socket that got its hello was healthy: start the backoff over
        // A hub going away (1001) is a deploy: the first reconnect goes at once, to whichever hub answers; a
        // draining one (4503) names the delay it drew for this socket.
        const drain = drainDelayMs(outcome.code, outcome.reason ?? '');
        if (drain !== null && attempt === 0) delayMs = drain;
        else delayMs = outcome.code === 1001 && attempt === 0 ? 0 : backoffDelay(attempt++, this.options.backoff, this.options.random);
      }
      await sleep(delayMs, this.stopping.signal);
    }
  }

  private refuse(refusal: Refusal): void {
    this.refusal = refusal;
    this.emit('refused', refusal);
  }

  private connectOnce(): Promise<SocketOutcome> {
    const url = new URL('/api/desktop/ws', this.options.hubUrl);
    url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
    const offered = this.options.protocolMajors.map((major) => `${SUBPROTOCOL_PREFIX}${major}`);
    return new Promise((resolve) => {
      let settled = false;
      let greeted = false;
      const settle = (outcome: SocketOutcome): void => {
        if (settled) return;
        settled = true;
        this.socket = null;
        this.stopHeartbeats();
        resolve(outcome);
      };
      const ws = new WebSocket(url, offered, {
        headers: { Authorization: `Bearer ${this.options.token}`,
                   ...(this.options.pushLease ? { [CAPABILITIES_HEADER]: PUSH_LEASE } : {}) },
        handshakeTimeout: 10_000,
      });
      this.socket = ws;
      this.connects += 1;
      ws.on('unexpected-response', (request, response) => {
        // Node's global agent keeps connections alive: once the refusal is read its socket would idle in the pool
        // until the hub's keep-alive timeout (holding the process open); it is closed instead.
        const socket = response.socket;
        const chunks: Buffer[] = [];
        response.on('data', (chunk: Buffer) => chunks.push(chunk));
        response.on('end', () => {
          let body: ErrorBody | null = null;
          try { body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as ErrorBody; } catch { body = null; }
          const retryAfter = Number(response.headers['retry-after']);
          settle({ kind: 'refused', status: response.statusCode ?? 0, body,
                   retryAfterS: Number.isFinite(retryAfter) && retryAfter >= 0 ? retryAfter : null });
          request.destroy();
          socket?.destroy();
        });
      });
      ws.on('message', (data, isBinary) => {
        if (isBinary) return;
        let event: { type?: unknown };
        try { event = JSON.parse(data.toString()) as { type?: unknown }; } catch { return; }
        if (event.type === 'hello') {
          greeted = true;
          this.subprotocol = ws.protocol;
        }
        this.onServerEvent(event);
      });
      ws.on('error', (error) => { this.emit('failure', error); });
      ws.on('close', (code, reason) => settle({ kind: 'closed', code, greeted, reason: reason.toString() }));
      if (this.stopping.signal.aborted) ws.close(1000, 'client stopping');
    });
  }

  private send(message: Heartbeat): void {
    if (this.socket?.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(message));
  }

  // ---- server events (one at a time: JavaScript runs this loop serially) ----------------------------------------
  private onServerEvent(event: { type?: unknown }): void {
    switch (event.type) {
      case 'hello': return this.onHello(event as Hello);
      case 'task_available': return this.onTaskAvailable(event as TaskAvailable);
      case 'task_control': return this.onTaskControl(event as TaskControl);
      case 'error': this.emit('serverError', event as ErrorEvent); return;
      case 'heartbeat_ack': return;
      default: return;  // a message type added after this SDK: ignored, as the protocol's rules say
    }
  }

  private onHello(hello: Hello): void {
    this.hello = hello;
    this.clientId = hello.client_id;
    this.interruptGeneration = Math.max(this.interruptGeneration, hello.interrupt_generation);
    this.known.clear();  // the replay that follows is the truth about queued work
    this.startHeartbeats(hello.heartbeat_interval_s);
    this.emit('hello', hello, this.subprotocol);
    this.pump();
  }

  private accepts(taskId: string, generation: number): boolean {
    const active = this.active.get(taskId);
    const last = Math.max(this.generations.get(taskId) ?? 0, active?.generation ?? 0);
    if (!acceptsGeneration(generation, last)) return false;
    this.generations.set(taskId, generation);
    if (active) active.generation = generation;
    this.interruptGeneration = Math.max(this.interruptGeneration, generation);
    return true;
  }

  private onTaskAvailable(event: TaskAvailable): void {
    this.emit('taskAvailable', event);
    if (event.kind !== 'monitor' || this.active.has(event.task_id)) return;
    if (!this.accepts(event.task_id, event.interrupt_generation ?? 0)) return;
    const pushed = pushedLease(event);
    if (pushed) {  // already ours: start at once (a replay of a lease already running was skipped above)
      this.known.set(event.task_id, event);  // for its traceparent
      this.pushedLeases += 1;
      this.run(pushed);
      return;
    }
    this.known.set(event.task_id, event);
    this.pump();
  }

  private onTaskControl(event: TaskControl): void {
    this.emit('taskControl', event);
    if (!this.accepts(event.task_id, event.interrupt_generation)) return;
    const active = this.active.get(event.task_id);
    if (!active) {
      if (event.control !== 'interrupt_requested') this.known.delete(event.task_id);
      return;
    }
    if (event.traceparent) active.traceparent = event.traceparent;
    if (event.control === 'interrupt_requested') {
      active.interruptRequested = true;
      // Not really started: yield now rather than at a safe point.
      if (NOT_STARTED.has(active.phase)) void this.yieldTask(active, null);
    } else if (event.control === 'cancelled' || event.control === 'lease_revoked') {
      this.end(active, event.control);  // the hub already ended it: stop, no callback
      this.pump();
    }
  }

  // ---- heartbeats ---------------------------------------------------------------------------------------------
  private startHeartbeats(intervalS: number): void {
    this.stopHeartbeats();
    this.heartbeat();
    this.heartbeatTimer = setInterval(() => this.heartbeat(), Math.max(1, intervalS) * 1000);
  }

  private stopHeartbeats(): void {
    if (this.heartbeatTimer) clearInterval(this.heartbeatTimer);
    this.heartbeatTimer = null;
  }

  private heartbeat(): void {
    const running = this.active.values().next().value as ActiveTask | undefined;
    const message: Heartbeat = { type: 'heartbeat', sent_at: new Date().toISOString(), local_queue_depth: this.known.size };
    const health = this.options.platformHealth?.();
    if (health) message.platform_health = health;
    if (running) {
      message.active_task_id = running.task.task_id;
      message.execution_phase = running.phase;
    }
    this.send(message);
  }

  // ---- leasing and running ------------------------------------------------------------------------------------
  /** Lease while there is room (serial: a call while one runs makes it run once more). */
  pump(): void {
    if (this.pumping) {
      this.pumpAgain = true;
      return;
    }
    this.pumping = (async () => {
      try {
        do {
          this.pumpAgain = false;
          await this.leaseFreeSlots();
        } while (this.pumpAgain && !this.stopping.signal.aborted);
      } catch (error) {
        this.emit('failure', error);
      } finally {
        this.pumping = null;
      }
    })();
  }

  private async leaseFreeSlots(): Promise<void> {
    let free = this.options.maxConcurrent - this.active.size;
    // Granted push-lease: leases arrive by themselves; a lease call only for work the hub said is queued.
    if (this.hello?.capabilities?.includes(PUSH_LEASE) && this.known.size === 0) return;
    while (free > 0 && !this.stopping.signal.aborted && this.refusal === null) {
      const { tasks } = await this.http.lease({ max_tasks: free });
      if (this.stopping.signal.aborted) return;  // stopped meanwhile: these leases expire on the hub
      if (tasks.length === 0) {
        this.known.clear();
        return;
      }
      for (const task of tasks) this.run(task);
      free -= tasks.length;
    }
  }

  private run(task: LeasedTask): void {
    if (leaseTokenEpoch(task.lease_token) !== (task.lease_epoch ?? 1)) {
      this.emit('failure', new Error(`lease of ${task.task_id}: its token does not carry its epoch`));
    }
    const traceparent = this.known.get(task.task_id)?.traceparent ?? undefined;
    this.known.delete(task.task_id);
    const generation = Math.max(task.interrupt_generation, this.generations.get(task.task_id) ?? 0);
    const active: ActiveTask = {
      task, phase: 'PREPARING', generation, interruptRequested: task.interrupt_requested ?? false,
      controller: new AbortController(), ended: null, lastSafePointAt: Date.now(), startedAt: new Date(),
      traceparent,
    };
    this.active.set(task.task_id, active);
    this.emit('leased', task);
    this.keepLeaseAlive(active);
    const running = this.execute(active).finally(() => {
      clearInterval(active.keepAlive);
      this.running.delete(running);
      this.active.delete(task.task_id);
      this.pump();  // straight on to the next (best) task
    });
    this.running.add(running);
  }

  private async execute(active: ActiveTask): Promise<void> {
    if (active.interruptRequested && NOT_STARTED.has(active.phase)) {
      await this.yieldTask(active, null);
      return;
    }
    const context: TaskContext = {
      task: active.task,
      signal: active.controller.signal,
      get phase() { return active.phase; },
      get interruptRequested() { return active.interruptRequested; },
      checkpoint: (next) => this.checkpoint(active, next),
    };
    let outcome: TaskOutcome;
    try {
      outcome = await this.options.execute(context);
    } catch (error) {
      if (active.ended) return;
      outcome = { status: 'failed', error: String(error instanceof Error ? error.message : error).slice(0, 2000) };
    }
    if (active.ended) return;  // yielded, ended by the hub, fenced or stopping: no result
    const body: ResultRequest = { ...outcome, lease_token: active.task.lease_token,
                                  started_at: active.startedAt.toISOString(), finished_at: new Date().toISOString() };
    try {
      const response = await this.http.result(active.task.task_id, body, active.traceparent);
      this.emit('result', active.task, outcome, (response as { result_id?: string }).result_id ?? null);
    } catch (error) {
      if (error instanceof HubHttpError && error.fenced) this.end(active, 'fenced');
      else this.emit('failure', error);
    }
  }

  private async checkpoint(active: ActiveTask, next: ExecutionPhase): Promise<boolean> {
    if (active.ended) return false;
    let intervalMs: number | null = null;
    if (SAFE_POINT_BEFORE.has(next)) {
      const now = Date.now();
      intervalMs = now - active.lastSafePointAt;
      active.lastSafePointAt = now;
    }
    if (active.interruptRequested && yieldsAt(active.task.execution_owner, active.phase, next)) {
      await this.yieldTask(active, intervalMs);
      return false;
    }
    active.phase = next;
    this.emit('phase', active.task, next);
    try {
      const response = await this.http.extend(active.task.task_id, {
        lease_token: active.task.lease_token, execution_phase: next,
        ...(intervalMs !== null ? { safe_point_interval_ms: Math.round(intervalMs) } : {}),
      }, active.traceparent);
      // The extend answer is a backup channel for a task_control the socket may have missed.
      if (response.interrupt_requested && this.accepts(active.task.task_id, response.interrupt_generation ?? 0)) {
        active.interruptRequested = true;
      }
      return !active.ended;
    } catch (error) {
      if (error instanceof HubHttpError && error.fenced) {
        this.end(active, 'fenced');
        return false;
      }
      throw error;
    }
  }

  /** A phase can outlast the lease (waiting on a slow platform): extend, with the phase unchanged, every third of
   * the lease's time (at least every 5 s, at most every 60 s) between checkpoints. */
  private keepLeaseAlive(active: ActiveTask): void {
    const ttlMs = Date.parse(active.task.lease_expires_at) - Date.now();
    const everyMs = Math.min(60_000, Math.max(5_000, ttlMs / 3));
    active.keepAlive = setInterval(() => {
      if (active.ended) return;
      this.http.extend(active.task.task_id, { lease_token: active.task.lease_token, execution_phase: active.phase },
                       active.traceparent).then((response) => {
        if (response.interrupt_requested && this.accepts(active.task.task_id, response.interrupt_generation ?? 0)) {
          active.interruptRequested = true;
        }
      }, (error: unknown) => {
        if (error instanceof HubHttpError && error.fenced) this.end(active, 'fenced');
      });
    }, everyMs);
  }

  /** Acknowledge the interrupt with cancel (reason collect_now_preempt, the generation seen); a newer generation on
   * the hub (409 stale_generation) is acknowledged in turn. */
  private async yieldTask(active: ActiveTask, safePointIntervalMs: number | null): Promise<void> {
    if (active.ended) return;
    this.end(active, 'yielded');
    const body = {
      lease_token: active.task.lease_token, reason: PREEMPT_REASON, interrupt_generation: active.generation,
      execution_phase: active.phase,
      ...(safePointIntervalMs !== null ? { safe_point_interval_ms: Math.round(safePointIntervalMs) } : {}),
    };
    try {
      try {
        await this.http.cancel(active.task.task_id, body, active.traceparent);
      } catch (error) {
        if (!(error instanceof HubHttpError && error.body.error === 'stale_generation'
              && typeof error.body.current_generation === 'number')) throw error;
        active.generation = error.body.current_generation;
        this.generations.set(active.task.task_id, active.generation);
        await this.http.cancel(active.task.task_id, { ...body, interrupt_generation: active.generation },
                               active.traceparent);
      }
      this.emit('yielded', active.task, active.generation, active.phase);
    } catch (error) {
      this.emit('failure', error);
    }
  }

  private end(active: ActiveTask, reason: EndReason): void {
    if (active.ended) return;
    active.ended = reason;
    active.controller.abort(reason);
    this.emit('ended', active.task, reason);
  }
}

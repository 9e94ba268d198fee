// The client's local rules (docs/desktop-protocol.md): safe points, interrupt generations, backoff. Pure functions.

import type { LeasedTask } from './generated/protocol.js';

export type ExecutionPhase = NonNullable<import('./generated/protocol.js').ExtendRequest['execution_phase']>;

/** The phases of one monitor task, in order. */
export const PHASES: readonly ExecutionPhase[] = [
  'PREPARING', 'NAVIGATING', 'AUTHENTICATING', 'INPUTTING', 'SUBMITTING', 'WAITING', 'PARSING', 'POSTING',
];

/** "Not really started": an interrupt here is honoured at once, not at a safe point. */
export const NOT_STARTED: ReadonlySet<ExecutionPhase> = new Set(['PREPARING', 'NAVIGATING']);

/** Safe points, as "about to enter this phase": before opening the page, typing, submitting, parsing. Never
 * during login (AUTHENTICATING), while waiting for the platform (WAITING) or while posting. */
export const SAFE_POINT_BEFORE: ReadonlySet<ExecutionPhase> = new Set(['NAVIGATING', 'INPUTTING', 'SUBMITTING', 'PARSING']);

export const PREEMPT_REASON = 'collect_now_preempt';

/** Close codes after which reconnecting is pointless or harmful (token rotated, client disabled, replaced by
 * another process with this token, an extension the hub will never negotiate). */
export const STOP_CLOSE_CODES: ReadonlyMap<number, string> = new Map([
  [4401, 'token_rotated'], [4403, 'client_disabled'], [4409, 'replaced'], [1010, 'mandatory_extension'],
]);

/** A draining hub (SIGTERM) closes with 4503 and names the delay before reconnecting in the reason
 * (`draining; reconnect after <N> ms`, N spread per socket so a hub's clients do not arrive elsewhere at once). */
export const DRAINING_CLOSE = 4503;

/** The delay a draining hub's close reason names, or null when it names none (reconnect with backoff). */
export function drainDelayMs(code: number, reason: string): number | null {
  if (code !== DRAINING_CLOSE) return null;
  const match = /^draining; reconnect after (\d+) ms$/.exec(reason);
  return match ? Number(match[1]) : null;
}

/** Act on an event only when its generation is at least the last one seen for the task. */
export function acceptsGeneration(eventGeneration: number, lastSeen: number): boolean {
  return eventGeneration >= lastSeen;
}

/** Does an interrupted task yield at the end of `phase`, about to enter `next`? desktop_tasks work yields at a
 * safe point; legacy work only while it has not really started, and otherwise runs to its result. */
export function yieldsAt(owner: LeasedTask['execution_owner'], phase: ExecutionPhase, next: ExecutionPhase): boolean {
  if (owner === 'legacy') return NOT_STARTED.has(phase);
  return SAFE_POINT_BEFORE.has(next);
}

export interface BackoffOptions {
  baseMs: number;
  maxMs: number;
}

export const DEFAULT_BACKOFF: BackoffOptions = { baseMs: 500, maxMs: 30_000 };

/** Exponential backoff with jitter: attempt n waits base * 2^n capped at max, times a random factor in [0.5, 1). */
export function backoffDelay(attempt: number, options: BackoffOptions = DEFAULT_BACKOFF,
                             random: () => number = Math.random): number {
  const capped = Math.min(options.maxMs, options.baseMs * 2 ** Math.min(attempt, 30));
  return capped * (0.5 + random() / 2);
}

/** The lease epoch a token carries (`lt1.{epoch}.{random}`), or null for a token of another shape. */
export function leaseTokenEpoch(token: string): number | null {
  const match = /^lt1\.(\d+)\./.exec(token);
  return match ? Number(match[1]) : null;
}

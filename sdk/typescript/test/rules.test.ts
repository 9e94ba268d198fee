import assert from 'node:assert/strict';
import { test } from 'node:test';

import { acceptsGeneration, backoffDelay, drainDelayMs, leaseTokenEpoch, PHASES, SAFE_POINT_BEFORE, yieldsAt } from '../src/rules.js';

test('backoff doubles up to its cap, with jitter in [50%, 100%)', () => {
  const options = { baseMs: 100, maxMs: 1000 };
  assert.equal(backoffDelay(0, options, () => 0), 50);
  assert.equal(backoffDelay(3, options, () => 0), 400);
  assert.equal(backoffDelay(10, options, () => 0), 500);
  assert.ok(backoffDelay(10, options, () => 0.999) < 1000);
});

test('an event older than the last generation seen is ignored', () => {
  assert.ok(acceptsGeneration(3, 3));
  assert.ok(acceptsGeneration(4, 3));
  assert.ok(!acceptsGeneration(2, 3));
});

test('desktop_tasks work yields only before a safe point; legacy work only before it really started', () => {
  const yieldsBefore = PHASES.slice(1).filter((next, i) => yieldsAt('desktop_tasks', PHASES[i]!, next));
  assert.deepEqual(yieldsBefore, [...SAFE_POINT_BEFORE]);
  assert.ok(yieldsAt('legacy', 'NAVIGATING', 'AUTHENTICATING'));
  assert.ok(!yieldsAt('legacy', 'INPUTTING', 'SUBMITTING'));
});

test('a lease token carries its epoch', () => {
  assert.equal(leaseTokenEpoch('lt1.7.abc'), 7);
  assert.equal(leaseTokenEpoch('opaque'), null);
});

test('a draining hub names the reconnect delay in its close reason; other closes name none', () => {
  assert.equal(drainDelayMs(4503, 'draining; reconnect after 2750 ms'), 2750);
  assert.equal(drainDelayMs(4503, 'draining'), null);
  assert.equal(drainDelayMs(1001, 'draining; reconnect after 2750 ms'), null);
  assert.equal(drainDelayMs(4503, 'draining; reconnect after -5 ms'), null);
});

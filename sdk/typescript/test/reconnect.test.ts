// The connection rules of docs/desktop-protocol.md against an in-process stand-in hub (node:http + ws): a dropped
// socket is reconnected and greeted again, a 429 waits Retry-After, a stop code ends the loop for good.
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { createServer, type IncomingMessage } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { test } from 'node:test';
import { WebSocketServer, type WebSocket } from 'ws';

import { DesktopClient } from '../src/index.js';

function hello(generation: number): string {
  return JSON.stringify({ type: 'hello', client_id: '00000000-0000-4000-8000-000000000001', tenant_id: 1,
                          hub_instance: 'stand-in', server_time: new Date().toISOString(), heartbeat_interval_s: 1,
                          interrupt_generation: generation, protocol_version: '1.2', a_field_from_the_future: true });
}

test('drop -> reconnect with a new hello; 429 -> Retry-After; 4403 -> stop', { timeout: 15_000 }, async () => {
  const steps: Array<(ws: WebSocket) => void> = [
    (ws) => { ws.send(hello(1)); ws.send(JSON.stringify({ type: 'from_the_future' })); ws.close(1013, 'too slow'); },
    (ws) => { ws.send(hello(2)); ws.close(4403, 'client disabled'); },
  ];
  const upgrades: string[] = [];
  const heartbeats: unknown[] = [];
  const wss = new WebSocketServer({ noServer: true, handleProtocols: (offered) => offered.has('monitor.desktop.v1') ? 'monitor.desktop.v1' : false });
  const server = createServer((request, response) => {
    response.writeHead(200, { 'Content-Type': 'application/json' }).end(JSON.stringify({ tasks: [] }));
    request.resume();
  });
  server.on('upgrade', (request: IncomingMessage, socket: Socket, head: Buffer) => {
    upgrades.push(String(request.headers['sec-websocket-protocol']));
    if (upgrades.length === 2) {  // between the two sockets: rate limited
      socket.end('HTTP/1.1 429 Too Many Requests\r\nRetry-After: 0\r\nContent-Type: application/json\r\n' +
                 'Connection: close\r\n\r\n{"error": "rate_limited", "message": "slow down"}');
      return;
    }
    wss.handleUpgrade(request, socket, head, (ws) => {
      ws.on('message', (data) => heartbeats.push(JSON.parse(data.toString())));
      steps.shift()!(ws);
    });
  });
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address() as AddressInfo;
  const client = new DesktopClient({ hubUrl: `http://127.0.0.1:${port}`, token: 'dct_test', idlePollMs: 0,
                                     backoff: { baseMs: 10, maxMs: 50 }, platformHealth: () => ({ openai: 'captcha' }),
                                     execute: async () => ({ status: 'failed' }) });
  const hellos: number[] = [];
  client.on('hello', (h) => hellos.push(h.interrupt_generation));
  const refused = once(client, 'refused');
  client.start();
  try {
    const [refusal] = await refused;
    assert.deepEqual(refusal, { reason: 'client_disabled', code: 4403 });
    assert.deepEqual(hellos, [1, 2]);
    assert.equal(client.interruptGeneration, 2);
    assert.equal(client.connects, 3);
    assert.deepEqual(upgrades, ['monitor.desktop.v1', 'monitor.desktop.v1', 'monitor.desktop.v1']);
    assert.ok(heartbeats.some((h) => (h as { platform_health?: unknown }).platform_health !== undefined));
    await new Promise((resolve) => setTimeout(resolve, 200));
    assert.equal(client.connects, 3, 'no reconnect after 4403');
  } finally {
    await client.stop();
    wss.close();
    server.closeAllConnections();
    server.close();
  }
});

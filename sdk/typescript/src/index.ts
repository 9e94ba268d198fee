export * from './client.js';
export * from './http.js';
export * from './rules.js';
export type * from './generated/protocol.js';
export { PROTOCOL_VERSION, SUPPORTED_MAJORS } from './generated/protocol.js';

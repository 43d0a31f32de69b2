// The browser edge's transport: a WebSocket to the cloud's --ws-port, one frame per binary message both
// ways (acespec/cloud/websocket.py), as a Link (session.ts) that CloudSession drives as it drives TCP.

import { Connector, Link } from "../session.js";

/** Connects to the WebSocket `url` (ws:// or wss://), whatever host and port the config names. */
export function wsConnector(url: string): Connector {
  return (cfg) => new Promise<Link>((resolve, reject) => {
    let ws: WebSocket;
    try {
      ws = new WebSocket(url);
    } catch (e) {
      reject(e);
      return;
    }
    ws.binaryType = "arraybuffer";
    let link: Link | null = null;
    let destroyed = false;
    const timer = setTimeout(() => {
      ws.close();
      reject(new Error(`connect timed out after ${cfg.connectTimeoutMs} ms`));
    }, cfg.connectTimeoutMs);
    ws.onopen = () => {
      clearTimeout(timer);
      link = new Link({
        write: (data) => ws.send(data),
        end: () => ws.close(1000),
        destroy: () => {
          destroyed = true;
          ws.close();
        },
        get destroyed() {
          return destroyed || ws.readyState >= WebSocket.CLOSING;
        },
      }, cfg.limits);
      resolve(link);
    };
    ws.onmessage = (ev: MessageEvent) => {
      // a text message is no frame: the decoder refuses it as the cloud would
      const data = typeof ev.data === "string" ? new TextEncoder().encode(ev.data) : new Uint8Array(ev.data as ArrayBuffer);
      link?.received(data);
    };
    ws.onclose = (ev: CloseEvent) => {
      if (link === null) {
        clearTimeout(timer);
        reject(new Error(`cannot open ${url} (WebSocket close code ${ev.code})`));
      } else {
        // 1000 after CLOSE(NORMAL or IDLE), 1001 after GOING_AWAY: the protocol's frames told the rest
        link.ended(ev.code === 1000 || ev.code === 1001 || ev.code === 1005 ? null
          : new Error(`the WebSocket closed with code ${ev.code}${ev.reason ? `: ${ev.reason}` : ""}`));
      }
    };
  });
}

// A small line chart on a canvas: requests per second on the left axis, mean latency and time
// to first token (seconds) on the right. No library: three polylines, two scales, a grid.

const COLORS = { rps: "#0969da", latency: "#9a6700", ttft: "#1a7f37", grid: "#dde3e8", text: "#66717a" };

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

export function drawTraffic(canvas, points) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const pad = { left: 40, right: 48, top: 10, bottom: 20 };
  const w = width - pad.left - pad.right;
  const h = height - pad.top - pad.bottom;
  const rpsMax = niceMax(Math.max(0, ...points.map((p) => p.rps)));
  const secondsMax = niceMax(
    Math.max(0, ...points.map((p) => Math.max(p.latency_avg || 0, p.ttft_avg || 0))),
  );
  g.font = "11px system-ui, sans-serif";
  g.strokeStyle = COLORS.grid;
  g.fillStyle = COLORS.text;
  g.lineWidth = 1;
  for (let i = 0; i <= 4; i += 1) {
    const y = pad.top + (h * i) / 4;
    g.beginPath();
    g.moveTo(pad.left, y);
    g.lineTo(pad.left + w, y);
    g.stroke();
    g.textAlign = "right";
    g.fillText(String(+(rpsMax * (1 - i / 4)).toFixed(2)), pad.left - 4, y + 4);
    g.textAlign = "left";
    g.fillText(`${+(secondsMax * (1 - i / 4)).toFixed(2)} s`, pad.left + w + 4, y + 4);
  }
  if (points.length) {
    const first = points[0].t;
    const last = points[points.length - 1].t;
    g.textAlign = "center";
    for (const [t, label] of [[first, `-${Math.round((last - first) / 60)} min`], [last, "now"]]) {
      const x = pad.left + (last === first ? w : (w * (t - first)) / (last - first));
      g.fillText(label, Math.min(Math.max(x, pad.left + 20), pad.left + w - 10), height - 5);
    }
  }
  const x = (index) => pad.left + (points.length > 1 ? (w * index) / (points.length - 1) : w);
  const line = (color, value, max) => {
    g.strokeStyle = color;
    g.lineWidth = 2;
    g.beginPath();
    let drawing = false;
    points.forEach((point, index) => {
      const v = value(point);
      if (v === null || v === undefined) {
        drawing = false;
        return;
      }
      const y = pad.top + h - (h * Math.min(v, max)) / max;
      if (drawing) g.lineTo(x(index), y);
      else g.moveTo(x(index), y);
      drawing = true;
    });
    g.stroke();
    g.fillStyle = color;  // a point with no neighbour draws no line: a dot instead
    points.forEach((point, index) => {
      const v = value(point);
      const alone = (i) => i < 0 || i >= points.length || value(points[i]) === null || value(points[i]) === undefined;
      if (v === null || v === undefined || !(alone(index - 1) && alone(index + 1))) return;
      g.beginPath();
      g.arc(x(index), pad.top + h - (h * Math.min(v, max)) / max, 2.5, 0, 2 * Math.PI);
      g.fill();
    });
  };
  line(COLORS.rps, (p) => p.rps, rpsMax);
  line(COLORS.latency, (p) => p.latency_avg, secondsMax);
  line(COLORS.ttft, (p) => p.ttft_avg, secondsMax);
}
